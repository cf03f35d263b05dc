"""The sender's measured link rate, which the group planner reads."""

from __future__ import annotations

import pytest

from vllm_layerkv.worker.link_rate import MIN_SAMPLE_BYTES, WINDOW_S, LinkRate


def test_unknown_until_a_sizeable_group_was_sent() -> None:
    rate = LinkRate()
    assert rate.bytes_per_s is None and rate.seconds_for(1 << 30) == 0.0
    rate.observe(MIN_SAMPLE_BYTES - 1, 0.001)  # per-write costs, not the link
    rate.observe(1 << 30, 0.0)                  # no time measured: no rate
    assert rate.bytes_per_s is None


def test_the_first_sample_is_the_rate_and_later_ones_weigh_half() -> None:
    rate = LinkRate()
    rate.observe(2_000_000_000, 1.0)
    assert rate.bytes_per_s == pytest.approx(2e9)
    assert rate.seconds_for(1_000_000_000) == pytest.approx(0.5)
    rate.observe(4_000_000_000, 1.0)
    assert rate.bytes_per_s == pytest.approx(3e9)
    for _ in range(12):  # a changed link is followed within a few groups
        rate.observe(10_000_000, 0.01)
    assert rate.bytes_per_s == pytest.approx(1e9, rel=1e-3)


def test_writes_landing_in_bursts_give_the_rate_of_their_busy_time() -> None:
    """Four 64 MiB writes in flight over 4 GB/s: the first lands after 67 ms of link time, the
    other three a fraction of a millisecond after it. Taken one by one these would say up to
    300 GB/s, and a sample cut after the first one 1 GB/s; a sample closes once no write is
    in flight, so every burst says 4 GB/s."""
    rate = LinkRate()
    n = 64 << 20
    per = n / 4e9
    for _ in range(3):
        rate.observe_write(n, 4 * per - 0.0006, others_in_flight=True)
        rate.observe_write(n, 0.0002, others_in_flight=True)
        rate.observe_write(n, 0.0002, others_in_flight=True)
        rate.observe_write(n, 0.0002, others_in_flight=False)
        assert rate.bytes_per_s == pytest.approx(4e9, rel=1e-6)


def test_writes_that_never_stop_make_a_sample_at_the_longest_window() -> None:
    """Always another write in flight (a backlog): the window closes at MAX_WINDOW_S, and the
    samples stay near the link's rate although a window may end inside a burst."""
    rate = LinkRate()
    n = 32 << 20
    per = n / 4e9
    samples = []
    for _ in range(40):
        rate.observe_write(n, 2 * per - 0.0001, others_in_flight=True)
        rate.observe_write(n, 0.0001, others_in_flight=True)
        if rate.bytes_per_s is not None:
            samples.append(rate.bytes_per_s)
    assert samples and all(3e9 < r < 5e9 for r in samples)


def test_writes_make_a_sample_only_once_they_cover_the_window() -> None:
    rate = LinkRate()
    rate.observe_write(8 << 20, WINDOW_S / 2, others_in_flight=False)
    assert rate.bytes_per_s is None
    rate.observe_write(8 << 20, WINDOW_S / 2, others_in_flight=True)
    assert rate.bytes_per_s is None  # the time is covered, but a write is still in flight
    rate.observe_write(8 << 20, 0.0, others_in_flight=False)
    assert rate.bytes_per_s == pytest.approx((24 << 20) / WINDOW_S)
    rate.observe_write(1 << 20, -1.0, others_in_flight=False)  # a clock step back: no time
    assert rate.bytes_per_s == pytest.approx((24 << 20) / WINDOW_S)

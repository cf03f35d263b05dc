"""The sender's measured link rate, which the group planner reads."""

from __future__ import annotations

import pytest

from vllm_layerkv.worker.link_rate import MIN_SAMPLE_BYTES, LinkRate


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

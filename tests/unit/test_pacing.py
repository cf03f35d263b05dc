"""transport/pacing.py: the token bucket that emulates a slower link (``tcp_pacing_gbps``),
alone with a stand-in clock, over a real socket pair, and through LayerKV's TCP transport
between a real sender and receiver."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kv_sides import assert_copied, push, start_d, start_p, task
from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport.pacing import MAX_BURST_BYTES, MIN_BURST_BYTES, TokenBucket, pacer_for
from vllm_layerkv.wire import framing


class FakeTime:
    """A clock that moves only when the bucket sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


def test_the_bucket_sends_its_credit_at_once_then_sleeps_off_the_debt() -> None:
    t = FakeTime()
    bucket = TokenBucket(1000.0, 100, clock=t.clock, sleep=t.sleep)
    bucket.take(100)  # the burst it holds
    assert t.slept == []
    bucket.take(50)  # 50 bytes of debt at 1000 B/s
    assert t.slept == [0.05]
    t.now += 1.0  # idle: the credit refills, but never past the burst
    bucket.take(100)
    bucket.take(100)
    assert t.slept == [0.05, 0.1]


def test_a_late_wake_up_is_paid_back_by_the_next_send() -> None:
    """Sleeping longer than asked leaves the sender behind; the refill counts the time that
    passed, so the next send waits that much less and the average rate holds."""
    t = FakeTime()
    bucket = TokenBucket(1000.0, 100, clock=t.clock, sleep=lambda s: t.sleep(s + 0.02))
    bucket.take(100)
    bucket.take(100)  # asks for 0.1 s, sleeps 0.12
    bucket.take(100)  # 20 bytes of credit came with the late wake-up: 0.08 + 0.02
    assert t.slept == [0.12, 0.1]
    # 300 bytes at 1000 B/s after a 100-byte burst take 0.2 s: behind by the last late
    # wake-up only, not by both
    assert t.now == pytest.approx(100.22)


def test_sizes_of_the_burst_and_what_zero_means() -> None:
    assert pacer_for(0.0) is None
    slow, fast = pacer_for(0.1), pacer_for(1000.0)
    assert slow is not None and fast is not None
    assert slow.rate == 12.5e6 and slow.burst == MIN_BURST_BYTES
    assert fast.rate == 125e9 and fast.burst == MAX_BURST_BYTES
    ten = pacer_for(10.0)
    assert ten is not None and ten.burst == 1_250_000  # 1 ms at 1.25 GB/s
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(0.0, 10)


def receive_all(sock: socket.socket, nbytes: int, done: list[float]) -> None:
    buf = bytearray(1 << 20)
    got = 0
    while got < nbytes:
        n = sock.recv_into(buf)
        if not n:
            break
        got += n
    done.append(time.monotonic())
    done.append(got)


ATTEMPTS = 3
"""A paced send is never faster than its rate, but a sender thread that other processes keep
off the CPU for longer than the bucket's burst loses that time (as a real link idles while
its sender stalls): on a busy machine one run of a few can come out slow."""


def paced_rate(gbps: float) -> float:
    """Bytes per second a paced send reached over a real socket pair, with a receiver that
    reads as fast as it can: the bucket's burst goes at once, the rest at the rate."""
    bucket = pacer_for(gbps)
    assert bucket is not None
    nbytes = int(bucket.rate * 0.4)  # 0.4 s at the rate
    payload = memoryview(bytearray(nbytes))
    a, b = socket.socketpair()
    done: list[float] = []
    reader = threading.Thread(target=receive_all, args=(b, nbytes, done))
    reader.start()
    try:
        t0 = time.monotonic()
        bucket.sendall(a, payload)
        reader.join(10)
    finally:
        a.close()
        b.close()
    assert done[1] == nbytes
    return (nbytes - bucket.burst) / (done[0] - t0)


@pytest.mark.parametrize("gbps", [0.2, 0.8])
def test_a_paced_socket_moves_bytes_at_the_rate(gbps: float) -> None:
    target = gbps * 1e9 / 8
    rates = []
    for _ in range(ATTEMPTS):
        rates.append(paced_rate(gbps))
        assert rates[-1] <= 1.04 * target, f"{rates[-1] / 1e6:.1f} MB/s: faster than the rate"
        if rates[-1] >= 0.96 * target:
            return
    pytest.fail(f"{[round(r / 1e6, 1) for r in rates]} MB/s, not within 4 % of "
                f"{target / 1e6:.1f} MB/s")


def test_layerkv_s_tcp_transport_paces_a_transfer_to_the_setting() -> None:
    """A real sender and receiver on loopback (LayerKV's TCP transport, the config knob, the
    hook in the channel): 16 MiB of KV at 0.4 Gb/s take 0.34 s, and arrive intact."""
    blocks, block_bytes = 64, 64 << 10
    d = start_d(num_blocks=blocks * ATTEMPTS, block_bytes=block_bytes, io_timeout=10.0)
    p = start_p("tcp", num_blocks=blocks, block_bytes=block_bytes,
                config=LayerKVConfig(tcp_pacing_gbps=0.4))
    try:
        rates, pairs = [], []
        for attempt in range(ATTEMPTS):
            tid = f"tid-{attempt}"
            src = list(range(blocks))
            dst = list(range(attempt * blocks, (attempt + 1) * blocks))
            d.table.expect(RecvTask(f"req-{attempt}", tid, dst))
            t0 = time.monotonic()
            push(p, [task(tid, d, src, dst, req_id=f"req-{attempt}")])
            out = p.wait_state(tid, ["acked", "failed"], timeout=20.0)
            seconds = time.monotonic() - t0
            assert out.state == "acked", out.reason
            d.drain_until(lambda f, x: bool(f or x))
            pairs += list(zip(src, dst))
            assert_copied(p, d, pairs)
            rates.append((out.nbytes - pacer_for(0.4).burst) / seconds)  # type: ignore[union-attr]
            assert rates[-1] < 1.02 * 50e6, f"{rates[-1] / 1e6:.1f} MB/s: faster than paced"
            # the connection's handshake and the ack add a little: it comes out just under
            if rates[-1] > 0.9 * 50e6:
                break
        else:
            pytest.fail(f"{[round(r / 1e6, 1) for r in rates]} MB/s, not about 50 MB/s")
    finally:
        p.sender.shutdown()
        d.transport.shutdown()


def test_without_pacing_the_channel_sends_on_the_socket_itself() -> None:
    """Off (the default) costs nothing: the payload goes straight to the socket, no bucket."""
    d = start_d()
    p = start_p("tcp")
    try:
        channel = p.sender._channel(d.endpoint)
        assert channel._streams._move is framing.send_all
    finally:
        p.sender.shutdown()
        d.transport.shutdown()


def test_the_setting_is_validated_and_read_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="tcp_pacing_gbps=-1.0 must be >= 0"):
        LayerKVConfig.from_extra_config({"tcp_pacing_gbps": -1})
    monkeypatch.setenv("LAYERKV_TCP_PACING_GBPS", "25")
    assert LayerKVConfig.from_extra_config({}).tcp_pacing_gbps == 25.0

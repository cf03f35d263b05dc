"""The TCP transport's own wire: handshake refusals, malformed frames, connections cut inside a
frame, waiting on high descriptors. What every transport must do (tcp, nixl, mooncake) is in
test_transport_conformance.py; both use the ends in kv_sides.py."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from kv_sides import (
    BLOCK_BYTES,
    NUM_BLOCKS,
    NUM_LAYERS,
    TIMEOUT,
    DSide,
    assert_sentinel,
    compat,
    make_caches,
    push,
    task,
)

from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport.base import TransportError
from vllm_layerkv.transport.tcp import TcpTransport
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import ChannelAuth, connect_handshake
from vllm_layerkv.wire.protocol import BlockData, Hello, HelloAck
from vllm_layerkv.worker.sender import FinishTransfer

# ------------------------------------------------------------------------------ refusals


def test_transfer_failed_on_d_is_reported_failed(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1]))
    d.table.close("t", failed=True, reason="kv_wait_timeout_s")
    assert d.table.drain() == (set(), {"r"})
    d.table.close("t", failed=True, reason="again")
    assert d.table.drain() == (set(), set())


def test_compat_mismatch_is_refused_with_the_field_named(d_side, p_side) -> None:
    d = d_side()
    bad = compat(block_size=32)
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(None), NUM_BLOCKS))
    with pytest.raises(TransportError) as e:
        TcpTransport().open_channel(
            d.endpoint, Hello(compat=bad, engine_id="p", tp_rank=0, tp_size=1), blocks,
            on_ack=lambda a: None, on_lost=lambda r: None, timeout=2.0, io_timeout=2.0)
    # the field is named, its values are not (they are in D's log only); D's address, which
    # may well contain "32" or "16", is left out of what is checked
    reason = str(e.value).split("refused the connection:", 1)[1]
    assert "block_size" in reason
    assert "32" not in reason and "16" not in reason
    # through the sender: the transfer fails with that reason, D's KV is untouched
    p = p_side(info=compat(dtype="bfloat16", model="other-model"))
    d.table.expect(RecvTask("r", "t", [1]))
    push(p, [task("t", d, [1], [1], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed"
    assert "dtype" in out.reason and "model" in out.reason and "bfloat16" not in out.reason
    assert_sentinel(d)
    assert d.table.pending() == 1  # a refused sender cannot fail D's transfer either


def test_tp_mismatch_is_refused(d_side) -> None:
    d = d_side()
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(None), NUM_BLOCKS))
    with pytest.raises(TransportError, match="tensor_parallel_size"):
        TcpTransport().open_channel(
            d.endpoint, Hello(compat=compat(), engine_id="p", tp_rank=0, tp_size=2), blocks,
            on_ack=lambda a: None, on_lost=lambda r: None, timeout=2.0, io_timeout=2.0)


# ------------------------------------------------------------------------------ failures


def _raw_sender(d: DSide, engine_id: str = "raw-p") -> socket.socket:
    sock = framing.connect(d.endpoint, 2.0)
    connect_handshake(sock, ChannelAuth(), 2.0)
    framing.send_message(sock, Hello(compat=compat(), engine_id=engine_id, tp_rank=0,
                                     tp_size=1))
    assert framing.recv_message(sock) == HelloAck(tp_rank=0)
    return sock


def test_connection_killed_mid_frame_fails_the_transfer(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    d.table.expect(RecvTask("other", "t-other", [5]))  # open, but no data from this source
    sock = _raw_sender(d)
    nbytes = 2 * 2 * BLOCK_BYTES
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0, 1], dst_blocks=[1, 2],
                                         block_bytes=BLOCK_BYTES, nbytes=nbytes))
    sock.sendall(b"\x01" * (nbytes // 2))
    time.sleep(0.1)
    sock.close()
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert d.table.pending() == 1  # t-other had no data from the lost source: still waiting


def test_a_sender_stalled_mid_frame_fails_the_transfer_after_io_timeout(d_side) -> None:
    """D reads a payload in one blocking call (``framing.set_io_timeout``); a sender that stops
    inside it still fails the transfer once the kernel's timeout runs out."""
    d = d_side(io_timeout=0.5)
    d.table.expect(RecvTask("r", "t", [1, 2]))
    sock = _raw_sender(d)
    nbytes = 2 * 2 * BLOCK_BYTES
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0, 1], dst_blocks=[1, 2],
                                         block_bytes=BLOCK_BYTES, nbytes=nbytes))
    sock.sendall(b"\x01" * (nbytes // 2))
    start = time.monotonic()
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert 0.4 < time.monotonic() - start < 5.0
    sock.settimeout(2.0)
    with pytest.raises((framing.PeerClosed, OSError)):  # D dropped the connection
        framing.recv_message(sock)
    sock.close()


def test_both_ends_of_a_data_connection_block_with_io_timeout_in_the_kernel(d_side) -> None:
    d = d_side()
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(None), NUM_BLOCKS))
    channel = TcpTransport().open_channel(
        d.endpoint, Hello(compat=compat(), engine_id="p", tp_rank=0, tp_size=1), blocks,
        on_ack=lambda a: None, on_lost=lambda r: None, timeout=2.0, io_timeout=3.0)
    try:
        sock = channel._sock
        assert sock.gettimeout() is None
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.calcsize("ll"))
        assert struct.unpack("ll", raw) == (3, 0)
    finally:
        channel.close()


def test_malformed_block_data_drops_the_connection(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    sock = _raw_sender(d)
    # a good frame first (so this source is known to the transfer) ...
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x07" * BLOCK_BYTES)
    # ... then a header whose nbytes does not match its blocks
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[2],
                                         block_bytes=BLOCK_BYTES, nbytes=10))
    sock.sendall(b"\x08" * 10)
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert d.block(0, 1) == b"\x07" * BLOCK_BYTES
    assert_sentinel(d, exclude={(0, 1)})
    sock.settimeout(2.0)
    with pytest.raises((framing.PeerClosed, OSError)):
        framing.recv_message(sock)
    sock.close()


def test_layer_out_of_range_is_malformed(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1]))
    sock = _raw_sender(d)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x07" * BLOCK_BYTES)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[NUM_LAYERS], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x08" * BLOCK_BYTES)
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert_sentinel(d, exclude={(0, 1)})
    sock.close()


def test_close_waits_for_a_write_in_progress(d_side) -> None:
    """Memory safety: a transfer is reported (and its blocks freed by vLLM) only once no write
    into them is running."""
    d = d_side()
    d.table.expect(RecvTask("r", "t", [3]))
    sock = _raw_sender(d)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[3],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x11" * (BLOCK_BYTES // 2))
    deadline = time.monotonic() + TIMEOUT
    while d.table._open["t"].writers != 1:  # the receiver is now inside the write
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closer = threading.Thread(target=d.table.close, args=("t", True, "kv_wait_timeout_s"))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned while a write into the blocks was in progress"
    assert d.table.drain() == (set(), set())
    sock.sendall(b"\x11" * (BLOCK_BYTES // 2))
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert d.table.drain() == (set(), {"r"})
    assert d.block(0, 3) == b"\x11" * BLOCK_BYTES  # the write finished before the report
    sock.close()


def _new_threads(before: set[threading.Thread], *prefixes: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in before and t.name.startswith(prefixes)]


def test_stops_return_once_the_threads_they_ended_have_ended(d_side, p_side) -> None:
    """A process may exit right after a stop. A thread still unwinding then meets the
    interpreter's shutdown, where Python ends it as it takes the GIL: inside native code that
    aborted the process ("terminate called without an active exception"). So closing P's
    channel (its ack reader, its TCP streams) and stopping D's receiver (its accept thread, a
    thread per connection and stream) return only once those threads have ended."""
    before = set(threading.enumerate())
    d, p = d_side(), p_side("tcp")
    d.table.expect(RecvTask("req-t", "t", [1]))
    push(p, [task("t", d, [1], [1])])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    p_threads = _new_threads(before, "layerkv-acks-", "layerkv-stream")
    d_threads = _new_threads(before, "layerkv-accept", "layerkv-recv-")
    assert len(p_threads) == 4 and len(d_threads) == 5  # tcp_streams=4: three more streams
    p.sender.shutdown()
    assert [t.name for t in p_threads if t.is_alive()] == []
    d.transport.shutdown()
    assert [t.name for t in d_threads if t.is_alive()] == []

def test_waiting_for_data_works_on_descriptors_above_1024() -> None:
    """vLLM processes hold many descriptors; select() fails on any >= 1024 (seen in CI-like
    runs with Mooncake engines alive), poll() does not."""
    import fcntl

    a, b = socket.socketpair()
    # the lowest free descriptor >= 1500: dup2 onto a fixed number would close whatever another
    # thread (NIXL's, UCX's) holds there, or fail with EBUSY while it is being opened
    high = socket.socket(fileno=fcntl.fcntl(a.fileno(), fcntl.F_DUPFD, 1500))
    assert high.fileno() >= 1500
    try:
        assert not framing.wait_readable(high, 0.05)
        b.sendall(b"x")
        assert framing.wait_readable(high, 1.0)
    finally:
        high.close()
        a.close()
        b.close()


# ------------------------------------------------------------------------------ lost connections


def _sent(p, tid: str, frames: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while p.out(tid).frames < frames:
        assert time.monotonic() < deadline, f"{tid}: {p.out(tid).frames} frames sent"
        time.sleep(0.01)


def test_word_of_a_lost_connection_fails_only_the_transfers_it_carried(d_side, p_side) -> None:
    """A connection's loss can be reported twice (its ack reader reads end of file while the
    sender's write fails), and the later report can come once the sender has opened a new
    connection and started the next transfer on it: only the transfers the lost connection
    carried fail, the next one lands."""
    d, p = d_side(), p_side("tcp")
    d.table.expect(RecvTask("r1", "t1", [10, 11]))
    push(p, [task("t1", d, [0, 1], [10, 11], req_id="r1")], finish=False)
    _sent(p, "t1", 2)
    lost = p.sender._channel(d.endpoint)
    report_loss = lost._on_lost
    lost._fail("send to decode failed: connection reset by peer")
    assert p.wait_state("t1", ["failed"]).reason.endswith("connection reset by peer")
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r1"})

    t2 = task("t2", d, [2, 3], [20, 21], req_id="r2")
    d.table.expect(RecvTask("r2", "t2", [20, 21]))
    push(p, [t2], finish=False)
    _sent(p, "t2", 2)
    assert p.sender._channels[d.endpoint] is not lost  # a new connection carries t2
    report_loss("connection to decode lost: connection closed by peer")  # the late report
    assert p.out("t2").state == "open", p.out("t2").reason
    p.sender.put(FinishTransfer(t2, t_compute_end=time.monotonic()))
    assert p.wait_state("t2", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: "r2" in f)[0] == {"r2"}

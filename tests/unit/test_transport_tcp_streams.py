"""transport/tcp_streams.py: how a frame's payload is dealt over a data connection's TCP
streams, and the streams through LayerKV's TCP transport between a real sender and receiver:
joined, sized by the smaller setting, authenticated, refused without the connection's token,
and lost in the middle of a frame."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter

import pytest

from kv_sides import assert_copied, assert_sentinel, compat, push, task
from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport import tcp_receiver, tcp_streams
from vllm_layerkv.transport.tcp_streams import deal
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import SECRET_ENV, ChannelAuth, connect_handshake
from vllm_layerkv.wire.protocol import (
    BlockData,
    Hello,
    HelloAck,
    Refused,
    StreamJoin,
    StreamJoinAck,
)

BLOCKS = 16
"""Blocks per transfer: a two-layer group of them is 128 KiB, 32 chunks of the 4 KiB below."""


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 4 KiB block per chunk, so that the tests' frames spread over every stream."""
    monkeypatch.setattr(tcp_streams, "CHUNK_BYTES", 4096)


@pytest.fixture
def pieces_by_socket(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Bytes D received into its KV, per socket (by file descriptor)."""
    got: Counter[int] = Counter()
    lock = threading.Lock()
    receive = tcp_receiver._receive_piece

    def counting(sock: socket.socket, piece: tcp_streams.Piece) -> None:
        receive(sock, piece)
        with lock:
            got[sock.fileno()] += piece if isinstance(piece, int) else len(piece)

    monkeypatch.setattr(tcp_receiver, "_receive_piece", counting)
    return got


def per_stream(payload: bytes, sizes: list[int], streams: int, chunk: int) -> list[bytes]:
    """Each stream's bytes when ``payload`` is moved as buffers of ``sizes``."""
    out = [bytearray() for _ in range(streams)]
    offset = 0
    for size in sizes:
        buf = payload[offset:offset + size]
        for index, start, end in deal(offset, size, streams, chunk):
            assert 0 < end - start <= chunk
            out[index] += buf[start:end]
        offset += size
    return [bytes(b) for b in out]


def test_the_deal_depends_on_payload_offsets_only_not_on_the_buffers() -> None:
    """P's buffers (runs of its blocks, staging halves) and D's (runs of its blocks) are cut
    differently; both ends must still put every byte on the same stream, in the same order."""
    payload = bytes(range(100))
    whole = per_stream(payload, [100], streams=3, chunk=8)
    assert whole == [b"".join(payload[k * 8:(k + 1) * 8] for k in range(first, 13, 3))
                     for first in range(3)]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 100), rng.randint(1, 30)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, 100])]
        assert per_stream(payload, sizes, streams=3, chunk=8) == whole


def _lands(p, d, name: str, src: list[int], dst: list[int]) -> None:
    """Transfer ``name`` of P's ``src`` blocks into D's ``dst``: acknowledged, reported once,
    the bytes intact and nothing else on D written."""
    d.table.expect(RecvTask(f"req-{name}", name, dst))
    push(p, [task(name, d, src, dst, req_id=f"req-{name}")])
    out = p.wait_state(name, ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert d.drain_until(lambda f, x: bool(f or x)) == ({f"req-{name}"}, set())
    assert_copied(p, d, list(zip(src, dst)))


def _transfer(d_side, p_side, d_config=None, p_config=None) -> tuple:
    d = d_side(config=d_config)
    p = p_side(config=p_config)
    _lands(p, d, "t", list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS)))
    return p, d


def test_a_transfer_goes_over_four_streams_and_lands_intact(d_side, p_side,
                                                             pieces_by_socket) -> None:
    p, d = _transfer(d_side, p_side)
    assert d.transport.connections == 4  # the default tcp_streams
    assert p.sender._channel(d.endpoint).streams == 4
    total = 4 * BLOCKS * 4096  # 4 layers
    assert sum(pieces_by_socket.values()) == total
    assert sorted(pieces_by_socket.values()) == [total // 4] * 4  # a quarter on each


def test_the_pair_uses_the_smaller_setting(d_side, p_side, pieces_by_socket) -> None:
    p, d = _transfer(d_side, p_side, d_config=LayerKVConfig(tcp_streams=2))
    assert d.transport.connections == 2 and p.sender._channel(d.endpoint).streams == 2
    assert len(pieces_by_socket) == 2
    pieces_by_socket.clear()
    _, d = _transfer(d_side, p_side, p_config=LayerKVConfig(tcp_streams=1))
    assert d.transport.connections == 1
    assert len(pieces_by_socket) == 1


def test_every_stream_authenticates_like_a_data_connection(
        d_side, p_side, pieces_by_socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "s" * 32)  # P and D, both in this process
    _, d = _transfer(d_side, p_side)
    assert d.transport.connections == 4 and len(pieces_by_socket) == 4
    # without the secret a stream cannot even present a token
    sock = framing.connect(d.endpoint, 2.0)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the handshake fails, whichever way
            connect_handshake(sock, ChannelAuth(), 2.0)
            framing.send_message(sock, StreamJoin(token="0" * 32, index=1))
            framing.recv_message(sock)
    finally:
        sock.close()


def _join(d_endpoint: str, token: str, index: int) -> object:
    sock = framing.connect(d_endpoint, 2.0)
    connect_handshake(sock, ChannelAuth(), 2.0)
    framing.send_message(sock, StreamJoin(token=token, index=index))
    answer = framing.recv_message(sock)
    if isinstance(answer, Refused):
        sock.settimeout(2.0)
        with pytest.raises((framing.PeerClosed, OSError)):  # and D closed the stream
            framing.recv_message(sock)
        sock.close()
    return answer, sock


def test_a_stream_joins_only_with_its_connection_s_token_and_a_free_index(d_side) -> None:
    d = d_side()
    control = framing.connect(d.endpoint, 2.0)
    connect_handshake(control, ChannelAuth(), 2.0)
    framing.send_message(control, Hello(compat=compat(), engine_id="raw-p", tp_rank=0,
                                        tp_size=1, streams=3))
    ack = framing.recv_message(control)
    assert isinstance(ack, HelloAck) and ack.streams == 3 and len(ack.stream_token) == 32
    refused, _ = _join(d.endpoint, "0" * 32, 1)
    assert isinstance(refused, Refused) and "no data connection offered" in refused.reason
    joined, stream = _join(d.endpoint, ack.stream_token, 1)
    assert joined == StreamJoinAck(index=1)
    for index in (1, 3, 0):  # taken, beyond what D granted, the connection itself
        refused, _ = _join(d.endpoint, ack.stream_token, index)
        assert isinstance(refused, Refused) and "not one this connection may" in refused.reason
    control.close()  # the connection ends: its streams end with it, its token is gone
    stream.settimeout(2.0)
    with pytest.raises((framing.PeerClosed, OSError)):
        framing.recv_message(stream)
    stream.close()
    refused, _ = _join(d.endpoint, ack.stream_token, 2)
    assert isinstance(refused, Refused)


def test_a_stream_lost_inside_a_frame_fails_the_transfer_on_both_ends(
        d_side, p_side, monkeypatch: pytest.MonkeyPatch) -> None:
    receive = tcp_receiver._receive_piece
    armed = threading.Event()
    seen: list[int] = []
    lock = threading.Lock()

    def lose_a_stream(sock: socket.socket, piece: tcp_streams.Piece) -> None:
        with lock:  # once armed, the second socket that gets a piece is lost: a stream
            if armed.is_set() and sock.fileno() not in seen:
                seen.append(sock.fileno())
            lose = armed.is_set() and len(seen) > 1 and sock.fileno() == seen[1]
            if lose:  # once: the next connection's sockets can reuse the lost ones'
                armed.clear()  # numbers
        if lose:  # what a reset connection does (a shut socket would still hand out what
            sock.shutdown(socket.SHUT_RDWR)  # it had buffered)
            raise ConnectionResetError("connection reset by peer")
        receive(sock, piece)

    monkeypatch.setattr(tcp_receiver, "_receive_piece", lose_a_stream)  # D's connection takes it
    p, d = _transfer(d_side, p_side)  # the connection and its four streams are up
    assert p.sender._channel(d.endpoint).streams == 4
    armed.set()
    src, dst = list(range(BLOCKS)), list(range(2 * BLOCKS, 3 * BLOCKS))
    d.table.expect(RecvTask("r1", "t1", dst))
    push(p, [task("t1", d, src, dst, req_id="r1")])
    out = p.wait_state("t1", ["acked", "failed"])
    assert out.state == "failed", seen
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r1"})
    # and a later transfer opens a new connection, with new streams, and lands, however late
    # the lost connection's threads report the loss
    d.table.expect(RecvTask("r2", "t2", [60, 61]))
    push(p, [task("t2", d, [0, 1], [60, 61], req_id="r2")])
    out = p.wait_state("t2", ["acked", "failed"])
    assert out.state == "acked", out.reason
    d.drain_until(lambda f, x: "r2" in f)
    assert p.sender._channel(d.endpoint).streams == 4
    written = range(BLOCKS, 2 * BLOCKS), dst, [60, 61]
    assert_sentinel(d, exclude={(layer, b) for layer in range(4) for part in written
                                for b in part})


def test_streams_the_listener_has_no_room_for_cost_speed_not_the_transfer(
        d_side, p_side, pieces_by_socket, caplog: pytest.LogCaptureFixture) -> None:
    """D's data listener serves two connections (``max_connections``): P's third stream is
    closed at admission, P logs it and deals its frames over the two that joined."""
    with caplog.at_level("WARNING", logger="vllm_layerkv.transport.tcp"):
        _, d = _transfer(d_side, p_side, d_config=LayerKVConfig(max_connections=2))
    assert d.transport.connections == 2
    assert len(pieces_by_socket) == 2
    assert "TCP stream 3 of 4" in caplog.text and "sending over 2" in caplog.text


def test_a_frame_d_no_longer_wants_is_dropped_from_every_stream_and_they_stay_in_step(
        d_side, p_side, pieces_by_socket) -> None:
    """D closed the transfer before its frames came: each stream's pieces are read and
    dropped, so the next transfer on the same connection finds every stream at its own
    frame's first byte and lands intact."""
    d, p = d_side(), p_side()
    src, dst = list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS))
    d.table.expect(RecvTask("r", "t", dst))
    d.table.close("t", failed=False, reason="aborted")  # D's request ended
    assert d.table.drain() == ({"r"}, set())
    push(p, [task("t", d, src, dst, req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "decode no longer waits" in out.reason
    assert_sentinel(d)
    dropped = dict(pieces_by_socket)
    assert len(dropped) == 4 and sum(dropped.values()) == 4 * BLOCKS * 4096
    _lands(p, d, "t2", src, list(range(2 * BLOCKS, 3 * BLOCKS)))
    assert d.transport.connections == 4  # the same connection and streams


def test_a_stream_p_loses_fails_the_transfer_on_d_at_once_not_after_io_timeout(
        d_side, p_side, monkeypatch: pytest.MonkeyPatch) -> None:
    """P's send on a stream fails: P stops the frame, and D, which still waits for the rest
    of the payload on the data connection, learns at once that the connection is dead. P's
    blocks are every other one (P reads one 4 KiB run at a time) and D's one run (D reads a
    layer at a time), so P stops at its second piece while D waits on stream 0 for its
    fifth."""
    send = framing.send_all
    armed = threading.Event()
    control: list[socket.socket] = []

    def reset_a_stream(sock: socket.socket, data: bytes | memoryview) -> None:
        if armed.is_set() and sock not in control and len(data) > 100:
            raise ConnectionResetError("connection reset by peer")
        send(sock, data)

    monkeypatch.setattr(framing, "send_all", reset_a_stream)  # P's streams take it
    p, d = _transfer(d_side, p_side)
    channel = p.sender._channel(d.endpoint)
    assert channel.streams == 4
    control.append(channel._sock)
    armed.set()
    src, dst = list(range(0, 2 * BLOCKS, 2)), list(range(2 * BLOCKS, 3 * BLOCKS))
    d.table.expect(RecvTask("r1", "t1", dst))
    start = time.monotonic()
    push(p, [task("t1", d, src, dst, req_id="r1")])
    out = p.wait_state("t1", ["acked", "failed"])
    assert out.state == "failed" and "connection reset" in out.reason
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r1"})
    assert time.monotonic() - start < 2.0  # D's io_timeout_s is 5 s


def test_a_frame_that_names_streams_the_connection_lacks_drops_the_connection(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    sock = framing.connect(d.endpoint, 2.0)
    connect_handshake(sock, ChannelAuth(), 2.0)
    framing.send_message(sock, Hello(compat=compat(), engine_id="raw-p", tp_rank=0, tp_size=1))
    assert framing.recv_message(sock) == HelloAck(tp_rank=0)  # no streams offered
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[1, 2],
                                         block_bytes=4096, nbytes=2 * 4096, streams=2))
    sock.settimeout(2.0)
    with pytest.raises((framing.PeerClosed, OSError)):  # D dropped the connection
        framing.recv_message(sock)
    sock.close()
    assert_sentinel(d)


def test_the_setting_is_validated_and_read_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, 17):
        with pytest.raises(ConfigError, match=f"tcp_streams={bad} must be between 1 and 16"):
            LayerKVConfig.from_extra_config({"tcp_streams": bad})
    monkeypatch.setenv("LAYERKV_TCP_STREAMS", "8")
    assert LayerKVConfig.from_extra_config({}).tcp_streams == 8

"""Payload I/O on a data connection (``framing.set_io_timeout``): blocking sockets with the
kernel's timeouts, so that one call moves a whole payload with the GIL released, and a peer
that stops moving bytes still fails the call after ``io_timeout_s``, saying so."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from vllm_layerkv.wire import framing

PAYLOAD = 16 << 20
"""Bytes of one test payload: larger than a loopback socket's buffers, so that a receiver
that returns with what has arrived needs several calls."""


class CountingSocket(socket.socket):
    """A socket that counts its ``recv_into`` calls: each is a point where the calling thread
    takes the GIL back."""

    calls = 0

    def recv_into(self, *args, **kwargs) -> int:  # type: ignore[override]
        self.calls += 1
        return super().recv_into(*args, **kwargs)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, CountingSocket]]:
    """A TCP loopback connection tuned as LayerKV's: (sending end, counting receiving end)."""
    srv = framing.listen("127.0.0.1", 0)
    out = socket.create_connection(srv.getsockname()[:2], timeout=5.0)
    conn, _ = srv.accept()
    srv.close()
    into = CountingSocket(fileno=conn.detach())
    for sock in (out, into):
        framing.tune(sock)
    yield out, into
    out.close()
    into.close()


def receive(into: socket.socket, send: bytes, sender: socket.socket) -> tuple[bytearray, float]:
    """``send`` from ``sender`` on a thread while ``into`` receives it whole; the bytes received
    and how long the receive took."""
    buf = bytearray(len(send))
    writer = threading.Thread(target=framing.send_all, args=(sender, send))
    start = time.monotonic()
    writer.start()
    # a signal caught mid-call (say SIGCHLD, as another test's child process ends) makes a
    # MSG_WAITALL receive return what it has so far: this thread blocks them meanwhile, so
    # that the count of calls shows the socket's mode and nothing else
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        framing.recv_exact_into(into, memoryview(buf))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    took = time.monotonic() - start
    writer.join(10)
    return buf, took


def test_a_data_connection_receives_a_whole_payload_in_one_call(pair) -> None:
    out, into = pair
    framing.set_io_timeout(out, 5.0)
    framing.set_io_timeout(into, 5.0)
    payload = bytes(range(256)) * (PAYLOAD // 256)
    got, took = receive(into, payload, out)
    assert got == payload
    # MSG_WAITALL: the whole payload in the kernel, the GIL released (a second call also comes
    # if the whole receive outlasts the 5 s kernel timeout)
    assert into.calls == 1, f"{into.calls} calls in {took:.2f} s"


def test_with_a_python_timeout_the_same_payload_takes_many_calls(pair) -> None:
    """What ``set_io_timeout`` replaces: Python's timeout makes the descriptor non-blocking, so
    every call returns with what has arrived and takes the GIL back."""
    out, into = pair
    out.settimeout(5.0)
    into.settimeout(5.0)
    payload = b"\x5a" * PAYLOAD
    got, _ = receive(into, payload, out)
    assert got == payload
    assert into.calls > 1


def test_the_timeout_is_the_kernels_and_the_socket_blocks(pair) -> None:
    out, _ = pair
    framing.set_io_timeout(out, 2.5)
    assert out.gettimeout() is None
    for opt in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
        raw = out.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("ll"))
        assert struct.unpack("ll", raw) == (2, 500000)
    framing.set_io_timeout(out, 1e-9)  # never zero: to the kernel that is no timeout at all
    raw = out.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll"))
    assert struct.unpack("ll", raw) != (0, 0)


def test_a_peer_that_stops_sending_mid_payload_fails_the_receive(pair) -> None:
    out, into = pair
    framing.set_io_timeout(into, 0.3)
    out.sendall(b"\x01" * 1000)  # half of what the receiver waits for, then nothing
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"nothing received for io_timeout_s=0\.3 s"):
        framing.recv_exact_into(into, memoryview(bytearray(2000)))
    assert 0.25 < time.monotonic() - start < 5.0


def test_a_peer_that_stops_reading_fails_the_send(pair) -> None:
    out, _ = pair  # the receiving end never reads
    framing.set_io_timeout(out, 0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"nothing sent for io_timeout_s=0\.3 s"):
        framing.send_all(out, bytes(256 << 20))  # more than both socket buffers hold
    assert time.monotonic() - start < 10.0


def test_a_closed_peer_still_ends_the_receive_at_once(pair) -> None:
    out, into = pair
    framing.set_io_timeout(into, 5.0)
    out.sendall(b"\x02" * 10)
    out.close()
    start = time.monotonic()
    with pytest.raises(framing.PeerClosed):
        framing.recv_exact_into(into, memoryview(bytearray(100)))
    assert time.monotonic() - start < 1.0

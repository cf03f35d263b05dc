"""Blocking socket helpers shared by the control channel and the TCP data transport.

``recv_message`` reads one frame within the limits of what the connection accepts next
(``protocol.MessageLimits``): a peer's length header decides what is read, never what is
allocated ahead of the bytes."""

from __future__ import annotations

import select
import socket
import struct

from vllm_layerkv.wire.protocol import (
    FRAME_HEADER,
    LIMITS,
    PREFILL_TO_DECODE,  # noqa: F401 - re-exported: what D's data connection reads after Hello
    Message,
    MessageLimits,
    ProtocolError,
    decode,
    encode,
)

FIRST_CHUNK = 64 * 1024
"""A frame's body is read into a buffer of this size first (every control message fits), which
then doubles, up to the frame's length, each time it is full: a peer that announces a long
frame and sends nothing costs one chunk, and a long frame's buffer is never more than twice
what has arrived."""


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock`` (raises PeerClosed on EOF). On a socket in
    ``set_io_timeout``'s blocking mode ``MSG_WAITALL`` makes it one call for the whole view,
    which waits in the kernel without Python's GIL; on a socket with a Python timeout the flag
    changes nothing (the descriptor is non-blocking) and each call returns what is there."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # set_io_timeout's kernel timeout ran out with nothing read
            raise TimeoutError(f"timed out: nothing received for {_io_timeout(sock)}") from None
        if k == 0:
            raise PeerClosed("connection closed by peer")
        got += k


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """``sock.sendall``, with ``set_io_timeout``'s kernel timeout reported as a timeout."""
    try:
        sock.sendall(data)
    except BlockingIOError:
        raise TimeoutError(f"timed out: nothing sent for {_io_timeout(sock)}") from None


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_message(sock: socket.socket, *kinds: type, limits: MessageLimits = LIMITS) -> Message:
    """Read and decode one frame, which may be one of ``kinds`` (what the connection accepts
    at this point; none: any type), at ``limits``. The length header is checked against the
    largest of those kinds before anything else is read, the body is read as its bytes arrive
    (``recv_growing``), and the decoded message must fit its own type's limit. Raises
    ProtocolError naming the type and limit (the caller drops the connection), PeerClosed, or
    the socket's OSError (its timeout)."""
    accepting = limits.accepting(*kinds)
    (length,) = FRAME_HEADER.unpack(recv_exact(sock, FRAME_HEADER.size))
    if length > accepting.max_bytes:
        raise ProtocolError(accepting.frame_refusal(length))
    msg = decode(recv_growing(sock, length))
    limits.check(msg, length)
    return msg


def recv_growing(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock``, in a buffer that grows as they arrive (``FIRST_CHUNK``)."""
    buf = recv_exact(sock, min(n, FIRST_CHUNK))
    while len(buf) < n:
        got = len(buf)
        buf.extend(bytes(min(got, n - got)))
        with memoryview(buf) as view:
            recv_exact_into(sock, view[got:])
    return buf


def send_message(sock: socket.socket, msg: Message) -> None:
    send_all(sock, encode(msg))


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop ``n`` bytes (payload of a transfer nobody wants any more)."""
    while n > 0:
        k = min(n, len(scratch))
        recv_exact_into(sock, scratch[:k])
        n -= k


def connect(address: str, timeout: float) -> socket.socket:
    """Open a TCP connection to ``host:port`` with Nagle off and big buffers."""
    host, port = split_endpoint(address)
    sock = socket.create_connection((host, port), timeout=timeout)
    tune(sock)
    return sock


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 8 * 1024 * 1024)
        except OSError:
            pass


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Put a data connection in blocking mode, with ``seconds`` as the kernel's send and
    receive timeouts (``SO_SNDTIMEO`` / ``SO_RCVTIMEO``: a call that moves nothing for that
    long fails, so a peer that stops reading or writing fails the transfer, not hangs it).

    Not Python's own socket timeout: that makes the descriptor non-blocking, so ``sendall``
    and ``recv_exact_into`` move a payload in as many calls as the socket buffer has room or
    bytes for, and take the GIL back between any two. In a vLLM process the engine's thread
    holds the GIL while it steps, and CPython hands it over only every switch interval (5 ms),
    so each of those calls can wait that long. In blocking mode one call moves a whole layer's
    payload with the GIL released throughout. Idle waits stay in ``wait_readable``."""
    sock.settimeout(None)
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    if whole == 0:
        micros = max(micros, 1)  # a timeval of zero is no timeout at all to the kernel
    timeval = struct.pack("ll", whole, micros)
    for opt in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, timeval)


def _io_timeout(sock: socket.socket) -> str:
    """The kernel timeout ``set_io_timeout`` gave ``sock``, for an error message."""
    try:
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                                         struct.calcsize("ll")))
    except OSError:
        return "the connection's io_timeout_s"
    return f"io_timeout_s={sec + usec / 1e6:g} s"


def listen(host: str, port: int) -> socket.socket:
    srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind((host, port))
    except OSError as e:
        srv.close()
        raise OSError(
            f"LayerKV cannot listen on {host}:{port} ({e}); set a free port in "
            "kv_connector_extra_config (0 = any free port) or a local address as 'host'"
        ) from None
    srv.listen(128)
    return srv


def split_endpoint(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint {address!r} is not host:port")
    return host.strip("[]"), int(port)


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    """True once ``sock`` has data (or EOF) within ``timeout`` seconds. ``poll``, not
    ``select``: a vLLM process holds many descriptors, and ``select`` fails on any >= 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(timeout * 1000))

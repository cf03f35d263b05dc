"""Parallel TCP streams for the byte payloads of one data connection (setting ``tcp_streams``).

One TCP connection moves a few GB/s at most, because the kernel copies its bytes on one core
at each end: on an H200 host's loopback, 64 MiB frames from Python threads moved 3.1 GB/s over
one connection, 6.6 over two and 12.4 over four. So with ``tcp_streams`` = N > 1, a data
connection that sends bytes gets up to N - 1 more TCP connections to the same decode worker,
its *streams*, and the payload of each ``BlockData`` frame is cut at every CHUNK_BYTES of the
payload, chunk k going on stream k mod N (the data connection itself is stream 0). Both ends
cut the same way, from payload offsets alone, so the cut needs no message and does not depend
on how either end's memory is split into buffers.

Order is kept exactly as on one connection: headers and every control message stay on the
data connection, D reads a frame's whole payload, on all its streams, before it reads the next
message, and P sends all of it before the next header. A block re-sent on the next chunk still
lands after the copy it replaces.

Joining: P's ``Hello`` asks for N streams; D's ``HelloAck`` grants up to its own setting, with
a random token. P opens each further stream like any data connection (D's ``Gate``, the
authentication handshake of ``wire/auth.py``), sends ``StreamJoin`` with the token and the
stream's index, and waits for ``StreamJoinAck``. A stream carries only payload bytes, and only
those its data connection's frames announce: it cannot open, complete or abort a transfer.
Each frame names the streams it is dealt over (``BlockData.streams``), so a stream that could
not join costs speed, not correctness. Losing a stream fails its data connection, with every
transfer on it, as losing the connection does.

Each stream beyond the first has one thread at each end, which moves the pieces the
connection's own thread hands it while that thread moves stream 0's.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterable, Iterator

from vllm_layerkv.common.threads import ThreadGroup

CHUNK_BYTES = 2 << 20
"""The unit dealt to the streams in turn. Small enough that every buffer the sender or receiver
moves at once (a layer's KV for a long prompt: 33.5 MB at 8K tokens of Llama-3.1-8B) spreads
over all streams, large enough that a piece is one system call of a millisecond or so."""

Piece = memoryview | int
"""What one stream moves for a frame: bytes to send or to receive into, or (D) a number of
bytes to read and drop (the payload of a transfer that was closed meanwhile)."""
Move = Callable[[socket.socket, Piece], None]


def deal(offset: int, size: int, streams: int, chunk: int = CHUNK_BYTES
         ) -> Iterator[tuple[int, int, int]]:
    """``(stream, start, end)`` for bytes ``[start, end)`` of a buffer of ``size`` bytes that
    sits at ``offset`` in its frame's payload, in order: the buffer cut at the payload's chunk
    boundaries, each piece on its chunk's stream."""
    start = 0
    while start < size:
        at = offset + start
        end = min(size, start + chunk - at % chunk)
        yield (at // chunk) % streams, start, end
        start = end


class StreamsFailed(ConnectionError):
    """A stream of the connection failed; the connection is over."""


class Streams:
    """The streams of one data connection beyond its first. ``move`` is what each end does
    with a piece: P sends it, D receives into it (or drops an int's worth of bytes)."""

    def __init__(self, name: str, move: Move, limit: int = 16) -> None:
        """``limit``: the streams the connection may have, stream 0 included."""
        self._name = name
        self._move = move
        self._limit = limit
        self._chunk = CHUNK_BYTES
        self._jobs: dict[int, queue.SimpleQueue[tuple[Piece, queue.SimpleQueue] | None]] = {}
        self._socks: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadGroup()
        """P: the streams' threads (D serves each stream in the thread that accepted it)."""

    def usable(self) -> int:
        """How many streams a frame may be dealt over: stream 0 and the joined streams
        1, 2, ... without a gap."""
        with self._lock:
            n = 1
            while n in self._jobs:
                n += 1
            return n

    def start(self, index: int, sock: socket.socket) -> None:
        """P: stream ``index`` has joined; its thread starts, and closes the socket once the
        connection is closed."""
        self.attach(index, sock)

        def serve_then_close() -> None:
            try:
                self.serve(index, sock)
            finally:
                sock.close()

        self._threads.start(serve_then_close, f"layerkv-stream{index}-{self._name}")

    def attach(self, index: int, sock: socket.socket) -> None:
        """Stream ``index`` joins (D: before it acknowledges the join, so that the frames P
        sends after the acknowledgement find it). Raises ValueError for an index this
        connection does not have or already has, StreamsFailed once it is closed."""
        with self._lock:
            if self._closed:
                raise StreamsFailed(f"connection {self._name} is closed")
            if not 1 <= index < self._limit or index in self._jobs:
                raise ValueError(f"stream {index} is not one this connection may still join "
                                 f"(it has streams 0-{self._limit - 1})")
            self._jobs[index] = queue.SimpleQueue()
            self._socks[index] = sock

    def serve(self, index: int, sock: socket.socket) -> None:
        """Move the pieces handed to attached stream ``index`` until ``close`` (D: in the
        thread that accepted the stream)."""
        jobs = self._jobs[index]
        while (job := jobs.get()) is not None:
            piece, done = job
            try:
                self._move(sock, piece)
            except BaseException as e:  # noqa: BLE001 - handed to the frame's thread
                # the other streams stop too: the peer, whose sends or reads on them would
                # otherwise wait for io_timeout_s, fails its end of the frame at once
                self.shut()
                done.put(e)
            else:
                done.put(None)

    def frame(self, stream0: socket.socket, buffers: Iterable[Piece], streams: int) -> None:
        """Move one frame's payload, ``buffers`` in payload order, dealt over ``streams``
        streams (at most ``usable()``: P deals over what it has, D refuses a header that names
        more); stream 0 is ``stream0``, moved by the calling thread. Every piece of a buffer
        has moved before the next buffer is taken from ``buffers`` (a sender's staging buffer
        is reused, a receiver's copied to the device, when its generator goes on). Raises the
        first failure, once no stream moves any piece of the frame any more."""
        offset = 0
        for buf in buffers:
            size = buf if isinstance(buf, int) else len(buf)
            if streams == 1:
                self._move(stream0, buf)
            else:
                self._deal(stream0, buf, offset, size, streams)
            offset += size

    def _deal(self, stream0: socket.socket, buf: Piece, offset: int, size: int,
              streams: int) -> None:
        done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        mine: list[Piece] = []
        handed = 0
        for index, start, end in deal(offset, size, streams, self._chunk):
            piece = end - start if isinstance(buf, int) else buf[start:end]
            if index == 0:
                mine.append(piece)
            else:
                self._jobs[index].put((piece, done))
                handed += 1
        failure: BaseException | None = None
        try:
            for piece in mine:
                self._move(stream0, piece)
        except BaseException as e:  # noqa: BLE001 - raised below, once the streams stopped
            failure = e
            self.shut()
        for _ in range(handed):  # no thread writes into (or reads from) buf after this
            result = done.get()
            if result is not None and failure is None:
                failure = result
                self.shut()
        if failure is not None:
            raise failure

    def shut(self) -> None:
        """Stop every stream's socket (a thread blocked on one returns with an error)."""
        with self._lock:
            socks = list(self._socks.values())
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """The connection is over: shut the streams and end their threads, waiting for the
        threads this end started (each thread's socket is closed by whoever opened it, once
        that thread has returned)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        self.shut()
        for q in jobs:
            q.put(None)
        self._threads.join()

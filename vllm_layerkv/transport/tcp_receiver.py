"""D's end of LayerKV's TCP connections (``tcp.py`` starts it; P's end is ``tcp_channel.py``).

The data listener admits each connection through a ``Gate`` (allowlist, ``max_connections``,
the authentication handshake; ``wire/admission.py``) and serves it on a thread of its own. The
first message says what the connection is. A ``Hello`` opens a data connection: D answers
with the direct planes it serves to that sender (an export each, and the receive ring a plane
writes head slices or bounced blocks into) and the TCP streams it grants, then reads the
sender's messages in order: byte frames into the KV through ``BlockIO``, ``DirectWrite`` and
``DirectRead`` granted and ended under the receive table's bookkeeping (``ReceiveSink``), ring
writes scattered into the blocks once P reports them, and ``TransferDone``,
``TransferNearlyDone`` and ``TransferAbort``. A ``StreamJoin`` opens a further TCP stream of a
data connection, which moves that connection's payload pieces (``tcp_streams.py``).

Each message names its ``Source`` (the connection's ``Hello`` and the connection itself), and
the receive table lets a transfer be written, completed or aborted only by the connection it
is bound to. When a connection ends, its granted writes end with it and the transfers bound to
it fail.
"""

from __future__ import annotations

import itertools
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import STOP_WAIT_S, ThreadGroup
from vllm_layerkv.kv import fused_copy
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.kv.bounds import BoundsError
from vllm_layerkv.kv.staging import RecvRing, StagingError, scatter
from vllm_layerkv.transport.base import ReceiveSink, Source, TransportError
from vllm_layerkv.transport.direct import (
    DirectPlane,
    DirectUnavailable,
    DirectWriteFailed,
    PeerReader,
)
from vllm_layerkv.transport.hooks import ConnectionHook
from vllm_layerkv.transport.tcp_streams import Piece, Streams, StreamsFailed
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import (Gate, ListenerLimits, Slot, close_listener,
                                          keepalive)
from vllm_layerkv.wire.auth import ChannelAuth
from vllm_layerkv.wire.protocol import (
    BlockData,
    DirectRead,
    DirectWrite,
    DirectWritten,
    Hello,
    HelloAck,
    ProtocolError,
    Refused,
    StreamJoin,
    StreamJoinAck,
    TransferAbort,
    TransferDone,
    TransferNearlyDone,
    WriteGrant,
)

logger = init_logger(__name__)
SCRATCH_BYTES = 4 * 1024 * 1024
SLOT_POLL_S = 0.001
"""How often a connection with a ring write waiting for a slot looks for one."""
_SCATTER_STREAMS: dict[int, torch.cuda.Stream] = {}
_links = itertools.count(1)
"""Numbers D's data connections (``Source.link``), each unique in this process."""


def _scatter_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for scattering received slices (off vLLM's streams)."""
    index = device.index or 0
    if index not in _SCATTER_STREAMS:
        _SCATTER_STREAMS[index] = torch.cuda.Stream(device)
    return _SCATTER_STREAMS[index]


@dataclass(frozen=True)
class RingShape:
    """D's receive rings, each made on first need (``recv_ring_slots`` x
    ``staging_buffer_mb``)."""

    slots: int = 4
    slot_bytes: int = 64 << 20


class TcpReceiver:
    """A decode worker's data listener and the connections it serves."""

    def __init__(self, planes: list[DirectPlane] | None = None, required: str = "",
                 ring: RingShape = RingShape(), auth: ChannelAuth | None = None,
                 limits: ListenerLimits | None = None, streams: int = 1,
                 new_hook: Callable[[], ConnectionHook] = ConnectionHook) -> None:
        """``planes``: the direct planes this worker serves, in order (the transport's own
        list: one that cannot run here is removed from it, for P's side too); ``required``:
        the ``transport`` setting when it named a plane; ``streams``: ``tcp_streams``, the
        most TCP streams a connection is granted; ``new_hook``: makes each connection's hook
        (``hooks.py``)."""
        self._planes = planes if planes is not None else []
        self._required = required
        self._ring_shape = ring
        self._auth = auth or ChannelAuth()
        self._limits = limits or ListenerLimits()
        self._streams = streams
        self._new_hook = new_hook
        self._gate: Gate | None = None
        self._stream_owners: dict[str, Streams] = {}
        """Stream token -> the streams of the connection that offered it."""
        self._ring: RecvRing | None = None
        """Where direct planes put head slices (mismatched TP); made on first need."""
        self._host_ring: RecvRing | None = None
        """The ring in pinned host memory for planes with ``host_bounce`` (every sender)."""
        self._ring_wait_s = 30.0
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._threads = ThreadGroup()
        """The accept thread and one thread per connection served."""
        self._lock = threading.Lock()

    def start(self, host: str, port: int, sink: ReceiveSink, blocks: BlockIO,
              io_timeout: float) -> str:
        """Prepare the planes, listen on ``host:port`` (0: any free port) and serve; returns
        the endpoint P connects to."""
        self._ring_wait_s = io_timeout / 2  # a grant must reach P before its io_timeout
        for plane in list(self._planes):
            try:
                plane.prepare()
            except DirectUnavailable as e:
                if self._required:
                    raise TransportError(f"transport={self._required}: {e}") from None
                logger.warning("LayerKV: %s unavailable on this decode worker (%s); prefill "
                               "instances will use another path", plane.name, e)
                self._planes.remove(plane)
        self._prepare_bounce(blocks)
        self._gate = Gate("data listener", host, self._auth, self._limits)
        self._server = framing.listen(host, port)
        bound_port = self._server.getsockname()[1]
        self._threads.start(self._accept_loop, "layerkv-accept", sink, blocks, io_timeout)
        return f"{host}:{bound_port}"

    def stop(self) -> None:
        """Accept no more connections."""
        self._stop.set()
        if self._server is not None:
            close_listener(self._server)

    def close_connections(self) -> None:
        """After ``stop``: shut every connection being served, and wait (up to STOP_WAIT_S)
        for their threads and the accept thread to return; each thread sees its socket end
        within milliseconds, and closes it."""
        if self._gate is not None:
            self._gate.shut_all()
        running = self._threads.join(STOP_WAIT_S)
        if running:
            logger.warning("LayerKV data listener: %d thread(s) still running %.0f s after "
                           "the stop: %s", len(running), STOP_WAIT_S, ", ".join(running))

    @property
    def connections(self) -> int:
        """Data connections (and streams) being served now."""
        return self._gate.active if self._gate is not None else 0

    def _accept_loop(self, sink: ReceiveSink, blocks: BlockIO, io_timeout: float) -> None:
        assert self._server is not None and self._gate is not None
        for conn, addr, slot in self._gate.accepted(self._server, self._stop):
            self._threads.start(self._serve, f"layerkv-recv-{addr[1]}", conn, addr, slot, sink,
                                blocks, io_timeout)

    def _serve(self, conn: socket.socket, addr: tuple, slot: Slot, sink: ReceiveSink,
               blocks: BlockIO, io_timeout: float) -> None:
        source: Source | None = None
        streams: Streams | None = None
        """The further TCP streams this connection offered P (``tcp_streams``)."""
        token = ""
        granted: dict[int, tuple[DirectWrite, int, RecvRing | None]] = {}
        """seq -> (request, ring slot or -1, its ring) of direct writes in progress."""
        waiting: deque[tuple[DirectWrite, RecvRing, float]] = deque()
        """Ring writes accepted by the bookkeeping and waiting for a free slot, oldest first,
        with the time by which one must be free."""
        rings: dict[str, RecvRing] = {}
        """plane name -> the receive ring offered to this sender with it."""
        reader: PeerReader | None = None
        """The sender's KV, mapped here, when this worker reads it (``cuda_ipc_reads``)."""
        hook = self._new_hook()
        assert self._gate is not None
        try:
            if not self._gate.authenticate(slot, addr):
                return
            keepalive(conn)
            framing.set_io_timeout(conn, io_timeout)
            first = framing.recv_message(conn, Hello, StreamJoin, limits=self._limits.messages)
            if isinstance(first, StreamJoin):
                self._serve_stream(conn, first)
                return
            if not isinstance(first, Hello):
                raise TransportError(f"expected Hello, got {type(first).__name__}")
            refusal = sink.check_hello(first)
            if refusal is not None:
                framing.send_message(conn, Refused(transfer_id="", reason=refusal))
                return
            source = Source(first.engine_id, first.tp_rank, first.tp_size, next(_links))
            tp_differs = first.tp_size != sink.tp_size
            exports = []
            for plane in self._planes:
                if plane.name not in first.direct:
                    continue
                if reader is None:  # this worker copies from the sender's KV (cuda_ipc_reads)
                    reader = plane.attach_reader(first, tp_differs)
                    if reader is not None:
                        exports.append(reader.export)
                        continue
                ring = self._ring_for(blocks, plane, tp_differs)
                export = plane.offer(first, ring)
                if export is None:
                    continue
                exports.append(export)
                if ring is not None and getattr(export, "ring_slots", 0):
                    rings[plane.name] = ring
            offered = max(1, min(first.streams, self._streams))
            streams = Streams(f"{addr[0]}:{addr[1]}", _receive_piece, limit=offered)
            if offered > 1:
                token = secrets.token_hex(16)
                with self._lock:
                    self._stream_owners[token] = streams
            framing.send_message(conn, HelloAck(tp_rank=sink.tp_rank, exports=exports,
                                                streams=offered, stream_token=token))
            while not self._stop.is_set():
                # Idle between transfers is fine; once a message starts, io_timeout applies.
                # A ring write waiting for a slot is retried between messages: the thread
                # keeps reading, since the write that frees a slot may be this sender's own.
                if waiting:
                    self._grant_waiting(conn, waiting, granted, sink, source)
                if not framing.wait_readable(conn, SLOT_POLL_S if waiting else 1.0):
                    continue
                msg = framing.recv_message(conn, *framing.PREFILL_TO_DECODE,
                                           limits=self._limits.messages)
                if isinstance(msg, BlockData):
                    self._receive_blocks(conn, msg, sink, blocks, streams, source)
                elif isinstance(msg, DirectRead) and reader is not None:
                    ok = self._read(msg, reader, sink, blocks, source)
                    framing.send_message(conn, WriteGrant(seq=msg.seq, ok=ok, slot=-1))
                elif isinstance(msg, DirectWrite) and exports:
                    ok = self._grant(msg, sink, blocks, source)
                    ring = rings.get(msg.plane) if msg.num_heads else None
                    if ok and msg.num_heads:
                        if not self._fits_ring(msg, ring, sink, source):
                            ok = False
                        else:  # granted in turn, when a slot is free (back-pressure)
                            assert ring is not None
                            waiting.append((msg, ring, time.monotonic() + self._ring_wait_s))
                            self._grant_waiting(conn, waiting, granted, sink, source)
                            if waiting and waiting[-1][0] is msg:
                                ring.waits += 1
                            continue
                    if ok:
                        granted[msg.seq] = (msg, -1, None)
                    framing.send_message(conn, WriteGrant(seq=msg.seq, ok=ok, slot=-1))
                elif isinstance(msg, DirectWritten) and msg.seq in granted:
                    request, slot, ring = granted.pop(msg.seq)
                    if slot >= 0:
                        self._end_ring_write(request, slot, msg.nbytes, ring, blocks, sink,
                                             source)
                    else:
                        sink.end_write(request.transfer_id, msg.nbytes)
                elif isinstance(msg, TransferDone):
                    _check_rank(msg, source)
                    ack = sink.on_done(msg.transfer_id, source.tp_rank, source.tp_size,
                                       msg.frames, msg.nbytes, source)
                    if ack is not None and hook.sends(ack):
                        framing.send_message(conn, ack)
                elif isinstance(msg, TransferNearlyDone):
                    _check_rank(msg, source)
                    sink.on_nearly_done(msg.transfer_id, source.tp_rank, msg.eta_s, source)
                elif isinstance(msg, TransferAbort):
                    sink.on_abort(msg.transfer_id, msg.reason, source)
                else:
                    raise TransportError(f"unexpected {type(msg).__name__} on a data connection")
        except (OSError, framing.PeerClosed, TransportError, Exception) as e:  # noqa: BLE001
            self._release_grants(granted, waiting, sink)
            if not self._stop.is_set() and isinstance(e, (ProtocolError, TransportError)):
                # said here too: a transfer not yet bound to the connection fails only later,
                # at kv_wait_timeout_s, without this reason (e.g. raise max_transfer_blocks)
                logger.error("LayerKV data listener dropped the connection from %s: %s",
                             addr[0], e)
            if not self._stop.is_set() and source is not None:
                sink.on_source_lost(source, f"connection lost: {e}")
        finally:
            if streams is not None:
                with self._lock:
                    self._stream_owners.pop(token, None)
                streams.close()
            self._release_grants(granted, waiting, sink)
            if reader is not None:
                reader.close()
            self._gate.release(slot)
            conn.close()

    def _release_grants(self, granted: dict[int, tuple[DirectWrite, int, RecvRing | None]],
                        waiting: deque[tuple[DirectWrite, RecvRing, float]],
                        sink: ReceiveSink) -> None:
        """The connection ended with writes granted (or waiting for a slot): they are over. P
        closes its socket only between writes (its sender thread owns both), and the writes of
        a P that died die with it (its CUDA context, its NIXL / Mooncake engine)."""
        for request, slot, ring in granted.values():
            if slot >= 0 and ring is not None:
                ring.release(slot)
            sink.end_write(request.transfer_id, 0)
        granted.clear()
        for request, _, _ in waiting:
            sink.end_write(request.transfer_id, 0)
        waiting.clear()

    # ------------------------------------------------------------------ receive rings
    def _ring_for(self, blocks: BlockIO, plane: DirectPlane, tp_differs: bool
                  ) -> RecvRing | None:
        """The receive ring to offer a sender with ``plane``: for a plane with
        ``host_bounce``, the host ring (every sender); else the ring on the KV's device, made
        when the first sender with another TP size connects (equal TP never pays for it).
        None when the plane needs no ring, and, with ``transport=auto``, when the KV is in
        host memory: head slices then go as bytes on this connection (zero-copy from and into
        the KV there). Engine rings in host memory run only when an engine is named: in CI's
        2-core vLLM runs they stalled at times, unexplained (docs/architecture.md, "What is NOT
        in this version")."""
        if plane.host_bounce:
            return self._bounce_ring(blocks)
        if not tp_differs:
            return None
        if not self._required and blocks.tensors[0].device.type != "cuda":
            return None
        with self._lock:
            if self._ring is None:
                shape = self._ring_shape
                self._ring = RecvRing(shape.slots, shape.slot_bytes, blocks.tensors[0].device)
                logger.info("LayerKV: receive ring for head slices, %d slots x %d MiB",
                            shape.slots, shape.slot_bytes >> 20)
            return self._ring

    def _prepare_bounce(self, blocks: BlockIO) -> None:
        """D side, at start-up: with a ``host_bounce`` plane, every sender's first write would
        otherwise wait for the host ring's allocation and registration and for the scatter
        kernel's compile (together about 0.2 s on an H200; docs/benchmarks.md, "the first
        request"); do them now."""
        bounce = [p for p in self._planes if p.host_bounce]
        if not bounce:
            return
        t = time.monotonic()
        try:
            ring = self._bounce_ring(blocks)
            for plane in bounce:
                plane.prepare_ring(ring)
            launches = fused_copy.warm_up(blocks.block_bytes, blocks.tensors[0].device,
                                          to_buf=False)
        except Exception as e:  # noqa: BLE001 - e.g. pinned memory refused
            # the first sender's connection tries again, and is refused saying why if it must
            logger.warning("LayerKV: could not prepare host_bounce at start-up (%s); the first "
                           "sender's connection will", e)
            return
        logger.info("LayerKV: host_bounce prepared at start-up in %.0f ms (receive ring "
                    "registered with %s; %d scatter kernel launches)",
                    (time.monotonic() - t) * 1e3, "+".join(p.name for p in bounce), launches)

    def _bounce_ring(self, blocks: BlockIO) -> RecvRing:
        """The ring in host memory (pinned when the KV is on a GPU) for ``host_bounce``."""
        with self._lock:
            if self._host_ring is None:
                shape = self._ring_shape
                self._host_ring = RecvRing(shape.slots, shape.slot_bytes, "cpu",
                                           pin_memory=blocks.tensors[0].device.type == "cuda")
                logger.info("LayerKV: receive ring in host memory for host_bounce, %d slots x "
                            "%d MiB", shape.slots, shape.slot_bytes >> 20)
            return self._host_ring

    @staticmethod
    def _fits_ring(msg: DirectWrite, ring: RecvRing | None, sink: ReceiveSink,
                   source: Source) -> bool:
        """Whether a ring write can be served at all; if not, the write is refused and the
        transfer failed, saying why."""
        try:
            if ring is None:
                raise StagingError("this connection has no receive ring")
            ring.check_fits(msg.nbytes)
        except StagingError as e:
            sink.end_write(msg.transfer_id, 0)
            sink.on_abort(msg.transfer_id, f"head-slice write refused: {e}", source)
            return False
        return True

    def _grant_waiting(self, conn: socket.socket,
                       waiting: deque[tuple[DirectWrite, RecvRing, float]],
                       granted: dict[int, tuple[DirectWrite, int, RecvRing | None]],
                       sink: ReceiveSink, source: Source) -> None:
        """Grant the waiting ring writes, in order, while slots are free; refuse (and fail the
        transfer of) one whose wait ran out. The caller's thread never blocks on the ring: P
        may hold a slot for a write it reports only once its next write is granted."""
        while waiting:
            msg, ring, deadline = waiting[0]
            slot = ring.try_acquire(msg.nbytes)
            if slot is None:
                if time.monotonic() < deadline:
                    return
                sink.end_write(msg.transfer_id, 0)
                sink.on_abort(msg.transfer_id, "head-slice write refused: no receive-ring slot "
                              f"was freed within {self._ring_wait_s:.1f} s", source)
                ok = False
            else:
                granted[msg.seq] = (msg, slot, ring)
                ok = True
            waiting.popleft()
            framing.send_message(conn, WriteGrant(seq=msg.seq, ok=ok, slot=slot if ok else -1))

    def _end_ring_write(self, request: DirectWrite, slot: int, nbytes: int,
                        ring: RecvRing | None, blocks: BlockIO, sink: ReceiveSink,
                        source: Source) -> None:
        """A ring write P reports done: scatter the slot into the blocks, then end the write.
        The write ends however the scatter does, since failing a transfer (here, or when the
        connection drops) waits until no write into it is open. A scatter the bounds checks
        refuse (heads, blocks or size outside D's KV; nothing was written) fails the transfer
        with the reason."""
        written, refusal = 0, ""
        try:
            written = self._scatter_slot(request, slot, nbytes, ring, blocks)
        except (BoundsError, StagingError) as e:
            refusal = f"head-slice write refused: {e}"
        finally:
            _end_write(sink, request.transfer_id, written, refusal, source)

    def _scatter_slot(self, request: DirectWrite, slot: int, nbytes: int,
                      ring: RecvRing | None, blocks: BlockIO) -> int:
        """Scatter a written ring slot into the blocks, then free the slot. Returns the bytes
        that landed (0 if P reported a failed write)."""
        assert ring is not None
        try:
            if nbytes != request.nbytes:
                return 0
            payload = ring.view(slot, nbytes)
            device = blocks.tensors[0].device
            if device.type == "cuda":
                stream = _scatter_stream(device)
                with torch.cuda.stream(stream):
                    if payload.device != device:  # host_bounce: the ring is pinned host memory
                        payload = payload.to(device, non_blocking=True)
                    scatter(payload, blocks.tensors, request.layers, request.dst_blocks,
                            request.first_head, request.num_heads, blocks.local_heads)
                stream.synchronize()  # before the slot is freed and the write reported
            else:
                scatter(payload, blocks.tensors, request.layers, request.dst_blocks,
                        request.first_head, request.num_heads, blocks.local_heads)
            return nbytes
        finally:
            ring.release(slot)

    def _read(self, msg: DirectRead, reader: PeerReader, sink: ReceiveSink, blocks: BlockIO,
              source: Source) -> bool:
        """Copy the blocks P announced from its KV into this worker's, under the same
        bookkeeping as a write P makes (``begin_write`` / ``end_write``); a failed copy fails
        the transfer here. Returns whether the blocks are in."""
        if not self._grant(msg, sink, blocks, source):
            return False
        nbytes, failure = 0, ""
        try:
            nbytes = reader.read(msg.layers, msg.src_blocks, msg.dst_blocks)
        except (DirectWriteFailed, ValueError) as e:
            failure = f"decode could not read the prefill's KV: {e}"
        finally:
            _end_write(sink, msg.transfer_id, nbytes, failure, source)
        return not failure

    @staticmethod
    def _grant(msg: DirectWrite | DirectRead, sink: ReceiveSink, blocks: BlockIO,
               source: Source) -> bool:
        if any(not 0 <= layer < blocks.num_layers for layer in msg.layers):
            raise TransportError(f"malformed {type(msg).__name__} for {msg.transfer_id}: layers "
                                 f"{msg.layers} outside 0..{blocks.num_layers - 1}")
        return sink.begin_write(msg.transfer_id, msg.dst_blocks, source)

    def _serve_stream(self, conn: socket.socket, join: StreamJoin) -> None:
        """A further TCP stream of a data connection (``tcp_streams.py``): joined to the
        connection whose token it presents, it moves that connection's payload pieces until
        the connection ends."""
        with self._lock:
            owner = self._stream_owners.get(join.token)
        try:
            if owner is None:
                raise ValueError("no data connection offered this stream token")
            owner.attach(join.index, conn)
        except (ValueError, StreamsFailed) as e:
            logger.error("LayerKV data listener refused a TCP stream: %s", e)
            framing.send_message(conn, Refused(transfer_id="", reason=f"TCP stream refused: {e}"))
            return
        framing.send_message(conn, StreamJoinAck(index=join.index))
        owner.serve(join.index, conn)

    @staticmethod
    def _receive_blocks(conn: socket.socket, msg: BlockData, sink: ReceiveSink,
                        blocks: BlockIO, streams: Streams, source: Source) -> None:
        if msg.num_heads and not (0 <= msg.first_head
                                  and msg.first_head + msg.num_heads <= blocks.local_heads):
            raise TransportError(f"malformed BlockData for {msg.transfer_id}: heads "
                                 f"[{msg.first_head}, {msg.first_head + msg.num_heads}) outside "
                                 f"this rank's {blocks.local_heads}")
        block_bytes = (blocks.slice_bytes(msg.num_heads) if msg.num_heads
                       else blocks.block_bytes)
        expected = len(msg.layers) * len(msg.dst_blocks) * block_bytes
        if msg.block_bytes != block_bytes or msg.nbytes != expected or any(
            not 0 <= layer < blocks.num_layers for layer in msg.layers
        ):
            raise TransportError(
                f"malformed BlockData for {msg.transfer_id}: block_bytes {msg.block_bytes} vs "
                f"{block_bytes}, nbytes {msg.nbytes} vs {expected}"
            )
        if not 1 <= msg.streams <= streams.usable():
            raise TransportError(f"malformed BlockData for {msg.transfer_id}: dealt over "
                                 f"{msg.streams} TCP streams, the connection has "
                                 f"{streams.usable()}")
        if not sink.begin_write(msg.transfer_id, msg.dst_blocks, source):
            streams.frame(conn, [msg.nbytes], msg.streams)  # read and dropped
            return
        written = 0
        bufs = (blocks.write_slices(msg.layers, msg.dst_blocks, msg.first_head, msg.num_heads)
                if msg.num_heads else blocks.write(msg.layers, msg.dst_blocks))
        try:
            streams.frame(conn, bufs, msg.streams)
            written = msg.nbytes
        finally:
            sink.end_write(msg.transfer_id, written)


_scratch = threading.local()


def _receive_piece(sock: socket.socket, piece: Piece) -> None:
    """D's move for a payload piece (``tcp_streams.Streams``): into its buffer, or, for an int,
    that many bytes read into this thread's scratch buffer and dropped (frames of a closed
    transfer). The scratch is made on first use: most connections never need it, and one that
    has not authenticated must not cost SCRATCH_BYTES."""
    if not isinstance(piece, int):
        framing.recv_exact_into(sock, piece)
        return
    if not hasattr(_scratch, "view"):
        _scratch.view = memoryview(bytearray(SCRATCH_BYTES))
    framing.discard(sock, piece, _scratch.view)


def _end_write(sink: ReceiveSink, transfer_id: str, nbytes: int, refusal: str,
               source: Source) -> None:
    """End a write D made into its own blocks (a ring scatter, a read), and fail the transfer
    when it was refused: in that order, since failing a transfer waits until no write into it
    is open."""
    sink.end_write(transfer_id, nbytes)
    if refusal:
        sink.on_abort(transfer_id, refusal, source)


def _check_rank(msg: TransferDone | TransferNearlyDone, source: Source) -> None:
    """A connection speaks for the P rank its ``Hello`` named, and for no other."""
    if msg.tp_rank != source.tp_rank:
        raise TransportError(f"{type(msg).__name__} for {msg.transfer_id} names prefill rank "
                             f"{msg.tp_rank} on the connection of rank {source.tp_rank}")

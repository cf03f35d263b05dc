"""P's end of a LayerKV TCP connection (``tcp.py`` opens it): sends each transfer's frames,
or, through a direct-write plane, asks D for each write and writes into D's memory itself.

Per transfer and layer group the sender thread calls ``write_blocks`` (or ``start_slices`` /
``finish_slices`` for staged head slices), then ``send_done``. With a plane attached, every write
is preceded by a ``DirectWrite`` request that D answers with a ``WriteGrant`` (``tcp_receiver.py``),
and followed by ``DirectWritten``; when D reads (``cuda_ipc_reads``) a ``DirectRead``
takes the place of all three, and D's answer comes once it has copied the blocks. Ring writes
(staged slices) may be several in flight, each holding one of D's ring slots until D scattered
it. Acks and grants arrive on this connection's ack-reader thread, the only other thread here;
a lost connection fails every transfer on it through ``on_lost``.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import STOP_WAIT_S, start_thread
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.transport.base import PendingWrite, SendChannel, TransportError
from vllm_layerkv.transport.direct import DirectWriteFailed, PeerWriter
from vllm_layerkv.transport.hooks import ConnectionHook
from vllm_layerkv.transport.tcp_streams import Streams
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.protocol import (
    BlockData,
    DirectRead,
    DirectWrite,
    DirectWritten,
    TransferAbort,
    TransferAck,
    TransferDone,
    TransferNearlyDone,
    WriteGrant,
)

logger = init_logger(__name__)
_NO_GRANT_YET = object()
GRANT_PATIENCE_S = 0.002
"""How long a sender with ring writes in flight waits for its next grant before it finishes
the oldest of them (D may be waiting for that one to free a slot)."""


@dataclass(frozen=True)
class WritePath:
    """How a channel's writes reach D's memory, as settled when it opened: bytes on the
    connection, or a direct plane's writer."""

    writer: PeerWriter | None = None
    """Set when P writes into D's memory itself (a direct plane) instead of sending bytes."""
    required: str = ""
    """The ``transport`` setting when it named a plane (head slices may not fall back)."""
    refusal: str = ""
    """Why no write can go to this decode (the required plane cannot reach it). The
    connection stays up so that each transfer fails at once and D is told, rather than D
    waiting out kv_wait_timeout_s for a channel that was never opened."""


class TcpSendChannel(SendChannel):
    def __init__(self, sock: socket.socket, endpoint: str, blocks: BlockIO,
                 on_ack: Callable[[TransferAck], None], on_lost: Callable[[str], None],
                 path: WritePath, io_timeout: float, hook: ConnectionHook,
                 streams: Streams | None = None):
        """``streams``: the connection's further TCP streams for byte payloads, which also
        send at the emulated link's rate (``tcp_pacing_gbps``) when it is set."""
        self._sock = sock
        self._endpoint = endpoint
        self._blocks = blocks
        self._on_ack = on_ack
        self._on_lost = on_lost
        self._alive = True
        self._failing = threading.Lock()
        self._writer = path.writer
        self._io_timeout = io_timeout
        self._required = path.required
        self._refusal = path.refusal
        self._hook = hook
        """This end's hook points (``hooks.py``): before each write, before each per-transfer
        message."""
        self._streams = streams or Streams(endpoint, framing.send_all)
        self._grants: queue.SimpleQueue[WriteGrant | None] = queue.SimpleQueue()
        self._seq = 0
        self._reader = start_thread(self._read_acks, f"layerkv-acks-{endpoint}")

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def direct(self) -> bool:
        return self._writer is not None

    @property
    def bounces(self) -> bool:
        return self._writer is not None and self._writer.host_bounce

    @property
    def streams(self) -> int:
        return 1 if self._writer is not None else self._streams.usable()

    @property
    def reads(self) -> bool:
        """D copies the blocks itself from this worker's KV (``cuda_ipc_reads``)."""
        return self._writer is not None and self._writer.reads

    def write_blocks(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                     dst_blocks: Sequence[int]) -> int:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("src_blocks and dst_blocks differ in length")
        self._check_writable(transfer_id)
        if self._writer is not None:
            return self._write_direct(transfer_id, layers, src_blocks, dst_blocks)
        block_bytes = self._blocks.block_bytes
        nbytes = len(layers) * len(src_blocks) * block_bytes
        header = BlockData(transfer_id=transfer_id, layers=list(layers),
                           dst_blocks=list(dst_blocks), block_bytes=block_bytes, nbytes=nbytes,
                           streams=self._streams.usable())
        try:
            framing.send_message(self._sock, header)
            self._streams.frame(self._sock, self._blocks.read(layers, src_blocks),
                                header.streams)
        except OSError as e:
            self._fail(f"send to {self._endpoint} failed: {e}")
            raise TransportError(f"send to decode {self._endpoint} failed: {e}") from None
        return nbytes

    def _check_writable(self, transfer_id: str) -> None:
        if self._refusal:
            raise TransportError(self._refusal)
        self._hook.before_write(transfer_id)

    def _write_direct(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                      dst_blocks: Sequence[int]) -> int:
        """Ask D for the blocks, write them through the plane, report the write complete; or,
        when D reads (``cuda_ipc_reads``), ask D to copy them and wait until it has."""
        assert self._writer is not None
        if self._writer.reads:
            done = self._ask(DirectRead(transfer_id=transfer_id, seq=0, layers=list(layers),
                                        src_blocks=list(src_blocks), dst_blocks=list(dst_blocks)))
            # not ok: D closed the transfer, or failed it because its copy failed
            return len(layers) * len(src_blocks) * self._blocks.block_bytes if done.ok else 0
        grant = self._ask(DirectWrite(transfer_id=transfer_id, seq=0, layers=list(layers),
                                      dst_blocks=list(dst_blocks)))
        seq = grant.seq
        if not grant.ok:
            return 0  # D closed the transfer; it will not be reported as received
        nbytes = 0
        try:
            nbytes = self._writer.write(layers, src_blocks, dst_blocks)
        except (DirectWriteFailed, ValueError) as e:
            raise TransportError(f"direct write to decode {self._endpoint} failed: {e}") from None
        finally:
            self._send(DirectWritten(transfer_id=transfer_id, seq=seq, nbytes=nbytes))
        return nbytes

    def write_slices(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], src_head: int, dst_head: int, num_heads: int,
                     staging: torch.Tensor) -> int:
        return self.finish_slices(self.start_slices(transfer_id, layers, src_blocks, dst_blocks,
                                                    src_head, dst_head, num_heads, staging))

    def start_slices(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], src_head: int, dst_head: int, num_heads: int,
                     staging: torch.Tensor, make_room: Callable[[], bool] | None = None
                     ) -> PendingWrite:
        """Through D's receive ring when the plane has one (posted, finished by
        ``finish_slices``), else as bytes on this connection (complete on return)."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("src_blocks and dst_blocks differ in length")
        self._check_writable(transfer_id)
        if self._writer is not None and self._writer.ring_slots:
            return self._post_to_ring(transfer_id, layers, src_blocks, dst_blocks, src_head,
                                      dst_head, num_heads, staging, make_room)
        if self._writer is not None and self._required:
            raise TransportError(
                f"transport={self._required} cannot write head slices into decode "
                f"{self._endpoint}: prefill and decode TP differ and decode offered no receive "
                "ring (see its log); use transport=auto or tcp")
        per_block = self._blocks.slice_bytes(num_heads)
        nbytes = len(layers) * len(src_blocks) * per_block
        header = BlockData(transfer_id=transfer_id, layers=list(layers),
                           dst_blocks=list(dst_blocks), block_bytes=per_block, nbytes=nbytes,
                           first_head=dst_head, num_heads=num_heads,
                           streams=self._streams.usable())
        payload = self._blocks.read_slices(layers, src_blocks, src_head, num_heads, staging)
        try:
            framing.send_message(self._sock, header)
            self._streams.frame(self._sock, [payload], header.streams)
        except OSError as e:
            self._fail(f"send to {self._endpoint} failed: {e}")
            raise TransportError(f"send to decode {self._endpoint} failed: {e}") from None
        return PendingWrite(transfer_id, nbytes)

    def _post_to_ring(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                      dst_blocks: Sequence[int], src_head: int, dst_head: int, num_heads: int,
                      staging: torch.Tensor, make_room: Callable[[], bool] | None
                      ) -> PendingWrite:
        """Ask D for a receive-ring slot, gather into it and post the write. D scatters the
        slot into its blocks when ``finish_slices`` reports the write, then frees the slot."""
        assert self._writer is not None
        nbytes = len(layers) * len(src_blocks) * self._blocks.slice_bytes(num_heads)
        grant = self._ask(DirectWrite(transfer_id=transfer_id, seq=0, layers=list(layers),
                                      dst_blocks=list(dst_blocks), first_head=dst_head,
                                      num_heads=num_heads, nbytes=nbytes,
                                      plane=self._writer.plane), make_room)
        if not grant.ok:
            return PendingWrite(transfer_id, 0)
        try:
            staged = self._writer.post_staged(self._blocks.local_heads, layers, src_blocks,
                                              src_head, num_heads, staging, grant.slot)
        except (DirectWriteFailed, ValueError) as e:
            self._send(DirectWritten(transfer_id=transfer_id, seq=grant.seq, nbytes=0))
            raise TransportError(f"direct write to decode {self._endpoint} failed: {e}") from None
        return PendingWrite(transfer_id, staged.nbytes, handle=(grant.seq, staged))

    def finish_slices(self, pending: PendingWrite) -> int:
        """Wait for a ring write, then report it (``DirectWritten``: D scatters the slot)."""
        if pending.handle is None:
            return pending.nbytes
        assert self._writer is not None
        (seq, staged), pending.handle = pending.handle, None
        written = 0
        try:
            written = self._writer.finish_staged(staged)
        except DirectWriteFailed as e:
            raise TransportError(f"direct write to decode {self._endpoint} failed: {e}") from None
        finally:
            self._send(DirectWritten(transfer_id=pending.transfer_id, seq=seq, nbytes=written))
        return written

    def slices_landed(self, pending: PendingWrite) -> bool:
        if pending.handle is None:
            return True
        assert self._writer is not None
        return self._writer.staged_done(pending.handle[1])

    def _ask(self, request: DirectWrite | DirectRead, make_room: Callable[[], bool] | None = None
             ) -> WriteGrant:
        """Send ``request`` under the next sequence number and wait for D's grant. With
        ``make_room`` (the caller has ring writes in flight), a grant that does not come at
        once may be waiting for a slot one of those writes holds: ``make_room`` finishes the
        oldest (False: none left), then the wait goes on."""
        self._seq += 1
        request.seq = self._seq
        self._send(request)
        deadline = time.monotonic() + self._io_timeout
        grant: WriteGrant | None | object = _NO_GRANT_YET
        while make_room is not None:
            grant = self._take_grant(GRANT_PATIENCE_S)
            if grant is not _NO_GRANT_YET:
                break
            try:
                if not make_room():
                    break
            except BaseException:
                self._settle(request, deadline)
                raise
        if grant is _NO_GRANT_YET:
            grant = self._take_grant(deadline - time.monotonic())
        if not isinstance(grant, WriteGrant) or grant.seq != request.seq:
            reason = (f"decode {self._endpoint} granted write {grant.seq}, expected "
                      f"{request.seq}" if isinstance(grant, WriteGrant) else
                      f"decode {self._endpoint} did not grant write {request.seq} within "
                      f"io_timeout_s={self._io_timeout:.0f}")
            self._fail(reason)
            raise TransportError(reason)
        return grant

    def _take_grant(self, timeout: float) -> WriteGrant | None | object:
        """The next grant; None once the connection failed; ``_NO_GRANT_YET`` after
        ``timeout``."""
        try:
            return self._grants.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return _NO_GRANT_YET

    def _settle(self, request: DirectWrite, deadline: float) -> None:
        """A request is out but its writer gave up (``make_room`` failed): take D's grant all
        the same and hand a granted slot straight back, so that the next grant on this
        connection is the next request's, and D's ring loses nothing."""
        grant = self._take_grant(deadline - time.monotonic())
        if not isinstance(grant, WriteGrant) or grant.seq != request.seq:
            self._fail(f"decode {self._endpoint} did not answer write {request.seq}")
            return
        if grant.ok:
            try:
                self._send(DirectWritten(transfer_id=request.transfer_id, seq=grant.seq,
                                         nbytes=0))
            except TransportError:
                pass

    def send_nearly_done(self, transfer_id: str, tp_rank: int, eta_s: float) -> None:
        self._send_transfer_message(TransferNearlyDone(transfer_id=transfer_id, tp_rank=tp_rank,
                                                       eta_s=max(0.0, eta_s)))

    def send_done(self, transfer_id: str, tp_rank: int, frames: int, nbytes: int) -> None:
        self._send_transfer_message(TransferDone(transfer_id=transfer_id, tp_rank=tp_rank,
                                                 frames=frames, nbytes=nbytes))

    def send_abort(self, transfer_id: str, reason: str) -> None:
        self._send_transfer_message(TransferAbort(transfer_id=transfer_id, reason=reason))

    def close(self) -> None:
        self._alive = False
        self._streams.close()
        if self._writer is not None:
            self._writer.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._reader is not threading.current_thread():  # close may come from on_lost
            self._reader.join(STOP_WAIT_S)

    def _send_transfer_message(self, msg: TransferNearlyDone | TransferDone | TransferAbort
                               ) -> None:
        if self._hook.sends(msg):
            self._send(msg)

    def _send(self, msg: TransferNearlyDone | TransferDone | TransferAbort | DirectWrite
              | DirectRead | DirectWritten) -> None:
        try:
            framing.send_message(self._sock, msg)
        except OSError as e:
            self._fail(f"send to {self._endpoint} failed: {e}")
            raise TransportError(f"send to decode {self._endpoint} failed: {e}") from None

    def _read_acks(self) -> None:
        try:
            while self._alive:
                # acks may be minutes apart: wait for readability, then read one message
                if not framing.wait_readable(self._sock, 1.0):
                    continue
                msg = framing.recv_message(self._sock, TransferAck, WriteGrant)
                if isinstance(msg, TransferAck):
                    self._on_ack(msg)
                elif isinstance(msg, WriteGrant):
                    self._grants.put(msg)
                else:
                    logger.warning("unexpected %s from decode %s", type(msg).__name__,
                                   self._endpoint)
        except (OSError, framing.PeerClosed, Exception) as e:  # noqa: BLE001 - thread boundary
            self._fail(f"connection to decode {self._endpoint} lost: {e}")

    def _fail(self, reason: str) -> None:
        """The channel is dead: its transfers fail here, and D hears of it at once (its end of
        the connection and of the streams reads end of file) instead of waiting io_timeout_s
        in the middle of a frame, e.g. for the rest of a payload a failed stream cut short."""
        with self._failing:  # the sender's write and the ack reader can both see the loss
            if not self._alive:
                return
            self._alive = False
        self._streams.shut()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._grants.put(None)  # wake a sender waiting for a grant
        self._on_lost(reason)

"""Same-host GPU-direct copies: one side's KV cache mapped into the other through CUDA IPC.

Why: over the TCP transport GPU KV crosses PCIe twice plus a socket (~4 GB/s measured on
2xH200). Two GPUs of one host reach each other over NVLink or PCIe peer-to-peer at tens to
hundreds of GB/s; NixlConnector gets there through UCX's cuda_ipc transport. This module does the
same with what torch already ships, so it needs nothing installed. Each side exports each layer's
KV tensor once, with ``UntypedStorage._share_cuda_`` (the mechanism ``torch.multiprocessing``
uses), and the other opens the handles with ``UntypedStorage._new_shared_cuda`` on *its own*
device: CUDA maps the peer device's allocation into its address space and enables peer access
on first use (``cudaIpcMemLazyEnablePeerAccess``). D offers its handles only to a sender on its
host (same boot id and hostname); P's go in its ``Hello``, after the handshake, and only a
process on P's host can open them.

* By default (``cuda_ipc_reads``) D reads: P offers its own KV in ``Hello.exports``, D maps it
  and copies each group itself when P sends ``DirectRead`` (as NixlConnector's D does through
  UCX's cuda_ipc), and P maps nothing of D's. Why: a decode GPU whose CUDA context maps a
  peer's memory runs its decode graph with shorter gaps between kernels
  (benchmarks/results/2026-11-27-x2-h200-decode-mapping); the direction does not change the
  bytes or the bookkeeping, since D's answer to ``DirectRead`` comes only once the blocks are in.
* P writes instead when either side has ``cuda_ipc_reads`` off, when the TPs differ (head
  slices go through D's receive ring), or when D cannot map P: D offers its KV in ``HelloAck``,
  P maps it and copies on P's GPU, so D's GPU only receives.
* Either way copies run on a side stream: one ``cudaMemcpyAsync`` per run of blocks adjacent on
  both sides (``paired_runs``: a fresh engine hands out free blocks counting up, one whose pool
  has gone round counting down), else a gather + scatter per layer.

The control messages (write grants, done, acks) stay on the TCP connection (``tcp.py``); this
module only maps memory and copies. Everything here runs in transport threads, never on the
forward path.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.kv.bounds import KVBounds
from vllm_layerkv.kv.staging import RecvRing, gather
from vllm_layerkv.transport.direct import (
    READ_SIDES,
    WRITE_SIDES,
    DirectPlane,
    DirectUnavailable,
    DirectWriteFailed,
    PeerReader,
    PeerWriter,
    StagedWrite,
    check_copy,
    check_geometry,
    check_staged,
    device_uuid,
    host_id,
    paired_runs,
)
from vllm_layerkv.wire.planes import DirectExport, IpcTensor, KVExport
from vllm_layerkv.wire.protocol import Hello

if TYPE_CHECKING:
    from vllm_layerkv.config import LayerKVConfig

logger = init_logger(__name__)
MAX_RUN_COPIES = 8
"""Up to this many paired runs per layer are copied with one memcpy each; more (scattered
blocks) switch to one gather + one scatter kernel per layer."""


def copy_blocks(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                layers: Sequence[int], src_blocks: Sequence[int],
                dst_blocks: Sequence[int], sides: tuple[str, str] = WRITE_SIDES) -> int:
    """Copy ``src[layer][src_blocks]`` into ``dst[layer][dst_blocks]`` for every layer, on the
    current stream; returns bytes copied. Tensors are ``[num_blocks, block_bytes]`` uint8.
    Every index is checked against both sides first (DirectWriteFailed, naming the side as
    ``sides`` does): a slice past the end would copy less, a negative one wrap, and on a GPU
    ``index_copy_`` write out of bounds."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("src_blocks and dst_blocks differ in length")
    if not check_copy(KVBounds.of(src), KVBounds.of(dst), layers, src_blocks, dst_blocks,
                      sides):
        return 0
    runs = paired_runs(src_blocks, dst_blocks)
    if len(runs) <= MAX_RUN_COPIES:
        for layer in layers:
            s_t, d_t = src[layer], dst[layer]
            for s0, d0, n in runs:
                d_t[d0:d0 + n].copy_(s_t[s0:s0 + n], non_blocking=True)
    else:
        device = src[layers[0]].device
        s_idx = torch.tensor(list(src_blocks), dtype=torch.long, device=device)
        d_idx = torch.tensor(list(dst_blocks), dtype=torch.long, device=device)
        for layer in layers:
            dst[layer].index_copy_(0, d_idx, src[layer].index_select(0, s_idx))
    return len(layers) * len(src_blocks) * src[layers[0]].shape[1]


def share(view: torch.Tensor) -> IpcTensor:
    """The IPC handle of ``view``'s storage and where ``view`` sits in it."""
    storage = view.untyped_storage()
    (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle,
     ev_sync) = storage._share_cuda_()
    return IpcTensor(
        handle=bytes(handle), storage_size=int(size), storage_offset=int(offset),
        tensor_offset=view.storage_offset() * view.element_size(),
        ref_counter_handle=bytes(rc_handle), ref_counter_offset=int(rc_offset),
        event_handle=bytes(ev_handle) if ev_handle else b"",
        event_sync_required=bool(ev_sync))


def export_kv(blocks: Sequence[torch.Tensor]) -> KVExport:
    """IPC handles of every layer's ``[num_blocks, block_bytes]`` view: D's, once at start; with
    ``cuda_ipc_reads``, P's too, once, for decode instances that read it."""
    first = blocks[0]
    return KVExport(host_id=host_id(), device_uuid=device_uuid(first.device),
                    num_blocks=first.shape[0], block_bytes=first.shape[1],
                    layers=[share(view) for view in blocks])


class PeerKV(PeerWriter, PeerReader):
    """Another worker's KV mapped into this process, and the stream this worker copies on: P
    maps D's to write into it (``write``, ``post_staged``); with ``cuda_ipc_reads`` D maps P's
    to read from it (``read``)."""

    plane = "cuda_ipc"

    def __init__(self, export: KVExport, local: Sequence[torch.Tensor], peer: str = "decode"):
        """``peer``: whose KV ``export`` is ("decode" or "prefill"), for messages."""
        if export.host_id != host_id():
            raise DirectUnavailable(f"{peer} runs on another host ({export.host_id})")
        if not local or local[0].device.type != "cuda":
            raise DirectUnavailable("this worker's KV is not on a CUDA device")
        if export.ring is None or export.block_bytes == local[0].shape[1]:
            check_geometry("cuda_ipc", len(export.layers), export.block_bytes, local)
        # else: TP differs, and only head slices go, through the ring
        self._device = local[0].device
        torch.cuda.set_device(self._device)  # maps and copies run on P's device
        self._src = list(local)
        try:
            self._dst = [self._open(t, export.num_blocks, export.block_bytes)
                         for t in export.layers]
            self._ring = (self._open(export.ring, export.ring_slots, export.ring_slot_bytes)
                          if export.ring is not None else None)
        except RuntimeError as e:  # not mappable here (no P2P, different container, ...)
            raise DirectUnavailable(f"cannot map {peer}'s KV through CUDA IPC: {e}") from None
        self.ring_slots = export.ring_slots if self._ring is not None else 0
        self._stream = torch.cuda.Stream(self._device)
        self.description = f"CUDA IPC, peer GPU {export.device_uuid}"

    def _open(self, t: IpcTensor, rows: int, row_bytes: int) -> torch.Tensor:
        """Map a ``[rows, row_bytes]`` uint8 view D shared."""
        if t.tensor_offset + rows * row_bytes > t.storage_size:
            raise DirectUnavailable("decode exported a view larger than its storage")
        storage = torch.UntypedStorage._new_shared_cuda(
            self._device.index, t.handle, t.storage_size, t.storage_offset,
            t.ref_counter_handle, t.ref_counter_offset, t.event_handle or None,
            t.event_sync_required)
        view = torch.empty(0, dtype=torch.uint8, device=self._device)
        view.set_(storage, t.tensor_offset, (rows, row_bytes), (row_bytes, 1))
        return view

    def post_staged(self, local_heads: int, layers: Sequence[int], src_blocks: Sequence[int],
                    src_head: int, num_heads: int, staging: torch.Tensor, slot: int
                    ) -> StagedWrite:
        """Gather the head slices on P's GPU, then one copy into D's ring slot, both queued
        on this writer's stream; ``finish_staged`` waits for the copy's event."""
        if self._ring is None:
            raise DirectWriteFailed("decode granted a receive-ring slot, but offered no ring")
        n = check_staged(KVBounds.of(self._src, local_heads), layers, src_blocks, src_head,
                         num_heads, slot, self._ring.shape[0], self._ring.shape[1])
        try:
            with torch.cuda.stream(self._stream):
                payload = gather(self._src, layers, src_blocks, src_head, num_heads,
                                 local_heads, staging)
                self._ring[slot, :n].copy_(payload, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
        except RuntimeError as e:
            raise DirectWriteFailed(f"device copy failed: {e}") from None
        return StagedWrite(n, copied)

    def finish_staged(self, write: StagedWrite) -> int:
        if write.pending is not None:
            copied, write.pending = write.pending, None
            try:
                copied.synchronize()
            except RuntimeError as e:
                raise DirectWriteFailed(f"device copy failed: {e}") from None
        return write.nbytes

    def staged_done(self, write: StagedWrite) -> bool:
        try:
            return write.pending is None or write.pending.query()
        except RuntimeError:  # finish_staged reports it
            return True

    def write(self, layers: Sequence[int], src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> int:
        """Copy and wait until the bytes are in D's memory; returns bytes copied."""
        return self._copy(self._src, self._dst, layers, src_blocks, dst_blocks, WRITE_SIDES)

    def read(self, layers: Sequence[int], src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        """D, ``cuda_ipc_reads``: copy P's blocks into this worker's and wait until they are
        in; returns bytes copied."""
        return self._copy(self._dst, self._src, layers, src_blocks, dst_blocks, READ_SIDES)

    def _copy(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
              layers: Sequence[int], src_blocks: Sequence[int], dst_blocks: Sequence[int],
              sides: tuple[str, str]) -> int:
        try:
            with torch.cuda.stream(self._stream):
                n = copy_blocks(src, dst, layers, src_blocks, dst_blocks, sides)
            self._stream.synchronize()
        except DirectWriteFailed:
            raise  # refused before anything was copied
        except RuntimeError as e:
            raise DirectWriteFailed(f"device copy failed: {e}") from None
        return n


class ReadByDecode(PeerWriter):
    """P side, when D reads (``KVExport.reads``): D has mapped this worker's KV and copies each
    group itself, so the channel sends ``DirectRead`` and nothing here moves bytes."""

    plane = "cuda_ipc"
    reads = True

    def __init__(self, export: KVExport):
        self.description = f"CUDA IPC, read by decode GPU {export.device_uuid}"

    def write(self, layers: Sequence[int], src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> int:
        raise DirectWriteFailed("decode reads this worker's KV itself (cuda_ipc_reads); the "
                                "channel asks it with DirectRead")


class CudaIpcPlane(DirectPlane):
    """Same-host device-to-device copies (``transport=auto|cuda_ipc`` with KV on CUDA)."""

    name = "cuda_ipc"

    def __init__(self, local: Sequence[torch.Tensor], reads: bool = False):
        super().__init__(local)
        self.reads = reads
        """``cuda_ipc_reads``: P offers this worker's KV to decode instances that read it; D
        maps each same-host sender's KV and copies from it."""
        self._export: KVExport | None = None
        self._ring_export: KVExport | None = None
        self._sender_export: KVExport | None = None
        self._lock = threading.Lock()
        """P: the sender's export is made once, by whichever channel opens first."""

    @classmethod
    def from_config(cls, local: Sequence[torch.Tensor], config: LayerKVConfig,
                    host_bounce: bool) -> CudaIpcPlane:
        return cls(local, reads=config.cuda_ipc_reads)

    def export_local(self) -> KVExport:
        """This worker's KV as IPC handles (raises RuntimeError when CUDA cannot share it)."""
        return export_kv(self.local)

    def map_peer(self, export: KVExport, peer: str) -> PeerKV:
        """Map another worker's KV (``peer``: "decode" or "prefill"; raises
        DirectUnavailable)."""
        return PeerKV(export, self.local, peer)

    def prepare(self) -> None:
        """D side, at start (main thread, before any forward pass)."""
        try:
            self._export = self.export_local()
        except RuntimeError as e:
            raise DirectUnavailable(f"cannot export this worker's KV cache: {e}") from None

    def offer(self, hello: Hello, ring: RecvRing | None = None) -> KVExport | None:
        """D side: the export for a sender on this host, else None; with ``ring`` (the
        sender's TP differs), the receive ring is shared too."""
        if hello.host_id != host_id() or self._export is None:
            return None
        if ring is None:
            return self._export
        if self._ring_export is None:  # the ring exists once; share it once
            self._ring_export = msgspec.structs.replace(
                self._export, ring=share(ring.tensor), ring_slots=ring.slots,
                ring_slot_bytes=ring.slot_bytes)
        return self._ring_export

    def attach(self, export: DirectExport) -> PeerWriter:
        """P side: map a decode worker's export (raises DirectUnavailable); when the decode
        reads this worker's KV itself, there is nothing to map."""
        assert isinstance(export, KVExport)
        if export.reads:
            return ReadByDecode(export)
        return self.map_peer(export, "decode")

    def sender_export(self) -> KVExport | None:
        """P side, ``cuda_ipc_reads``: this worker's KV, for decode instances that read it
        (made on first use); None without the setting, so that P's default path exports
        nothing of its memory."""
        if not self.reads:
            return None
        with self._lock:
            if self._sender_export is None:
                try:
                    self._sender_export = self.export_local()
                except RuntimeError as e:
                    logger.warning("LayerKV cuda_ipc: cannot export this worker's KV for "
                                   "decode instances that read it (%s); they will be written "
                                   "to instead", e)
                    return None
            return self._sender_export

    def attach_reader(self, hello: Hello, tp_differs: bool) -> PeerKV | None:
        """D side, ``cuda_ipc_reads``: map the sender's KV on this worker's device, when it
        offered it and runs on this host with this worker's TP (head slices for another TP
        go through the receive ring, which P writes). None: P writes, as without the
        setting; the log says why."""
        if not self.reads or self._export is None or hello.host_id != host_id():
            return None
        offered = next((e for e in hello.exports if isinstance(e, KVExport)), None)
        why = ("it offered no KV" if offered is None else
               "its TP differs from this worker's" if tp_differs else "")
        reader = None
        if not why:
            try:
                reader = self.map_peer(offered, "prefill")
            except DirectUnavailable as e:
                why = str(e)
        if reader is None:
            # on by default: a sender that does not offer its KV, or runs another TP, is a
            # supported set-up; only a mapping that failed is worth a warning
            log = logger.warning if offered is not None and not tp_differs else logger.info
            log("LayerKV cuda_ipc_reads: prefill rank %d writes into this worker instead (%s)",
                hello.tp_rank, why)
            return None
        reader.export = msgspec.structs.replace(self._export, layers=[], reads=True)
        return reader

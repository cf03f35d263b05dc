"""Same-host GPU-direct copies: D's KV cache mapped into P through CUDA IPC handles.

Why: over the TCP transport GPU KV crosses PCIe twice plus a socket (~4 GB/s measured on
2xH200). Two GPUs of one host reach each other over NVLink or PCIe peer-to-peer at tens to
hundreds of GB/s; NixlConnector gets there through UCX's cuda_ipc transport. This module does the
same with what torch already ships, so it needs nothing installed:

* D exports each layer's KV tensor once, at start, with ``UntypedStorage._share_cuda_`` (the
  mechanism ``torch.multiprocessing`` uses) and offers the handles in ``HelloAck`` to a sender
  that runs on the same host (same boot id and hostname).
* P opens them with ``UntypedStorage._new_shared_cuda`` on *its own* device: CUDA maps the peer
  device's allocation into P's address space and enables peer access on first use
  (``cudaIpcMemLazyEnablePeerAccess``), so P's copies run on P's GPU and D's GPU only receives.
* P copies on a side stream: one ``cudaMemcpyAsync`` per run of blocks adjacent on both sides
  (the common case: vLLM hands out free blocks in order), else a gather + scatter per layer.

The control messages (write grants, done, acks) stay on the TCP connection (``tcp.py``); this
module only maps memory and copies. Everything here runs in transport threads, never on the
forward path.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from functools import lru_cache

import torch

from vllm_layerkv.protocol import IpcTensor, KVExport

logger = logging.getLogger("vllm.layerkv.transport.cuda_ipc")
MAX_RUN_COPIES = 8
"""Up to this many paired runs per layer are copied with one memcpy each; more (scattered
blocks) switch to one gather + one scatter kernel per layer."""


class DirectUnavailable(RuntimeError):
    """Device-direct copies cannot be set up with this peer; the message says why."""


@lru_cache(maxsize=1)
def host_id() -> str:
    """Identity of this host: two processes with equal ids can share CUDA IPC handles."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def paired_runs(src_blocks: Sequence[int],
                dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src_start, dst_start, length) that are consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                layers: Sequence[int], src_blocks: Sequence[int],
                dst_blocks: Sequence[int]) -> int:
    """Copy ``src[layer][src_blocks]`` into ``dst[layer][dst_blocks]`` for every layer, on the
    current stream; returns bytes copied. Tensors are ``[num_blocks, block_bytes]`` uint8."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("src_blocks and dst_blocks differ in length")
    if not layers or not src_blocks:
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


def export_kv(blocks: Sequence[torch.Tensor]) -> KVExport:
    """D side, once at start: IPC handles of every layer's ``[num_blocks, block_bytes]`` view."""
    first = blocks[0]
    layers = []
    for view in blocks:
        storage = view.untyped_storage()
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle,
         ev_sync) = storage._share_cuda_()
        layers.append(IpcTensor(
            handle=bytes(handle), storage_size=int(size), storage_offset=int(offset),
            tensor_offset=view.storage_offset() * view.element_size(),
            ref_counter_handle=bytes(rc_handle), ref_counter_offset=int(rc_offset),
            event_handle=bytes(ev_handle) if ev_handle else b"",
            event_sync_required=bool(ev_sync)))
    return KVExport(host_id=host_id(), device_uuid=device_uuid(first.device),
                    num_blocks=first.shape[0], block_bytes=first.shape[1], layers=layers)


class PeerKV:
    """P side: D's KV mapped into this process, and the stream P copies into it on."""

    def __init__(self, export: KVExport, local: Sequence[torch.Tensor]):
        if export.host_id != host_id():
            raise DirectUnavailable(f"decode runs on another host ({export.host_id})")
        if not local or local[0].device.type != "cuda":
            raise DirectUnavailable("this worker's KV is not on a CUDA device")
        if len(export.layers) != len(local) or export.block_bytes != local[0].shape[1]:
            raise DirectUnavailable(
                f"decode exported {len(export.layers)} layers x {export.block_bytes} B blocks, "
                f"this worker has {len(local)} x {local[0].shape[1]} B")
        self._device = local[0].device
        torch.cuda.set_device(self._device)  # maps and copies run on P's device
        self._src = list(local)
        try:
            self._dst = [self._open(t, export) for t in export.layers]
        except RuntimeError as e:  # not mappable here (no P2P, different container, ...)
            raise DirectUnavailable(f"cannot map decode's KV through CUDA IPC: {e}") from None
        self._stream = torch.cuda.Stream(self._device)
        self.peer_device = export.device_uuid

    def _open(self, t: IpcTensor, export: KVExport) -> torch.Tensor:
        nbytes = export.num_blocks * export.block_bytes
        if t.tensor_offset + nbytes > t.storage_size:
            raise DirectUnavailable("decode exported a KV view larger than its storage")
        storage = torch.UntypedStorage._new_shared_cuda(
            self._device.index, t.handle, t.storage_size, t.storage_offset,
            t.ref_counter_handle, t.ref_counter_offset, t.event_handle or None,
            t.event_sync_required)
        view = torch.empty(0, dtype=torch.uint8, device=self._device)
        view.set_(storage, t.tensor_offset, (export.num_blocks, export.block_bytes),
                  (export.block_bytes, 1))
        return view

    def copy(self, layers: Sequence[int], src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        """Copy and wait until the bytes are in D's memory; returns bytes copied."""
        if any(not 0 <= b < self._dst[0].shape[0] for b in dst_blocks):
            raise ValueError(f"destination block out of range in {list(dst_blocks)[:8]}")
        with torch.cuda.stream(self._stream):
            n = copy_blocks(self._src, self._dst, layers, src_blocks, dst_blocks)
        self._stream.synchronize()
        return n


class DirectPeering:
    """The policy half of ``transport=auto|cuda_ipc`` for one worker: what D offers, and
    whether P may fall back to sending bytes when a peer cannot be mapped."""

    def __init__(self, local: Sequence[torch.Tensor], required: bool):
        self.required = required
        self._local = list(local)
        self._export: KVExport | None = None

    def prepare_export(self) -> None:
        """D side, at start (main thread, before any forward pass)."""
        try:
            self._export = export_kv(self._local)
        except RuntimeError as e:
            if self.required:
                raise DirectUnavailable(
                    f"transport=cuda_ipc: cannot export this worker's KV cache: {e}") from None
            logger.warning("LayerKV: KV cache cannot be exported through CUDA IPC (%s); "
                           "same-host prefill instances will send bytes over TCP", e)

    def offer(self, want_direct: bool, peer_host_id: str) -> KVExport | None:
        """D side: the export for a sender that asked for it from this host, else None."""
        if want_direct and peer_host_id == host_id():
            return self._export
        return None

    def attach(self, export: KVExport) -> PeerKV:
        """P side: map a decode worker's export (raises DirectUnavailable)."""
        return PeerKV(export, self._local)

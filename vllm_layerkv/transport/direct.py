"""Direct-write planes: ways for P to put KV into D's memory itself, instead of sending bytes.

Every plane follows the same three steps, and the TCP control connection (``tcp.py``) does the
rest, so completion, ordering and failure semantics are the transport's, not the plane's:

1. D, at start: ``prepare()`` registers or exports its KV memory with the plane.
2. D, per sender: ``offer(hello)`` returns what that sender needs to reach the memory (an
   export in ``HelloAck``), or None when the plane cannot serve it (e.g. CUDA IPC to another
   host).
3. P, per decode rank: ``attach(export)`` returns a ``PeerWriter``; the sender thread calls its
   ``write`` between D's ``WriteGrant`` and P's ``DirectWritten``, so D's bookkeeping guards
   its blocks exactly as for bytes it receives.

When P and D use different TP, D also offers its receive ring (``staging.RecvRing``) in the
export, and P's ``write_staged`` gathers a head slice into a staging buffer and writes it into
the ring slot D granted; D scatters the slot into its blocks when P reports the write.

``host_bounce`` (NIXL, Mooncake, KV on GPUs): the engine never touches GPU memory. D's ring is
in pinned host memory and offered to every sender; P sends whole blocks through it as well,
gathering a layer group on its GPU and copying it into the staging buffer's registered pinned
host twin, which the engine writes into D's ring slot; D copies the slot to its GPU and
scatters it. For engine
paths that move host memory far faster than GPU memory (UCX over tcp).

Ring writes come in two halves, ``post_staged`` and ``finish_staged``, so that the sender can
keep several in flight (``writes_in_flight``): P posts the next piece before it waits for the
last, and D scatters one piece while the next is written. How much more overlaps depends on the
engine: NIXL over UCX tcp does much of a WRITE inside the post call, on the sender's thread.

A writer checks every request before its plane moves a byte (``check_copy``,
``check_staged``): layers and block ids against this worker's KV and against D's as exported,
the head range, and the slot D granted and the write's size against D's ring. An engine or a
mapped copy writes wherever its address arithmetic points, so nothing else stands between a bad
index and D's memory.

Planes: ``cuda_ipc.py`` (same host, KV on CUDA), ``nixl.py`` (NIXL agents: UCX, libfabric...),
``mooncake.py`` (Mooncake TransferEngine, tcp or rdma).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.kv.bounds import BoundsError, KVBounds, check_slot
from vllm_layerkv.kv.staging import RecvRing, StagingError, copy_block_runs, gather
from vllm_layerkv.wire.planes import DirectExport
from vllm_layerkv.wire.protocol import Hello

if TYPE_CHECKING:
    from vllm_layerkv.config import LayerKVConfig

logger = init_logger(__name__)


class DirectUnavailable(RuntimeError):
    """A direct plane cannot serve this peer (or this worker); the message says why."""


class DirectWriteFailed(RuntimeError):
    """A direct write was attempted and did not complete; the transfer fails."""


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
    """The identity of a CUDA device, the same in every process that sees it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def paired_runs(src_blocks: Sequence[int],
                dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src_start, dst_start, length) of pairs that are consecutive on both
    sides: one descriptor / memcpy each, named by the run's lowest pair. A fresh engine hands
    out free blocks counting up. vLLM frees a request's blocks last first and reuses them in
    that order, so once its pool has gone round, a prompt's blocks count down; a run that
    counts down on both sides covers the same span as one that counts up."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("src_blocks and dst_blocks differ in length")
    runs: list[tuple[int, int, int, int]] = []  # first pair, length, step (0: one pair)
    for s, d in zip(src_blocks, dst_blocks):
        if runs:
            s0, d0, n, step = runs[-1]
            if step >= 0 and s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1, 1)
                continue
            if step <= 0 and s == s0 - n and d == d0 - n:
                runs[-1] = (s0, d0, n + 1, -1)
                continue
        runs.append((s, d, 1, 0))
    return [(s0 - n + 1, d0 - n + 1, n) if step < 0 else (s0, d0, n)
            for s0, d0, n, step in runs]


def memory_regions(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The distinct memory behind ``tensors`` as ``(address, nbytes)``, overlapping ranges
    merged: layers may share memory (KV-sharing layers; in hybrid models, layers of different
    KV cache groups own different blocks of one buffer), and engines refuse to register the
    same bytes twice."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def check_geometry(plane: str, num_layers: int, block_bytes: int, local: Sequence[torch.Tensor]
                   ) -> None:
    """The peer's KV must have this worker's layer count and block size (the Hello check
    already compared the models; this guards the addresses the plane computes)."""
    if num_layers != len(local) or block_bytes != local[0].shape[1]:
        hint = ("; prefill and decode TP differ, and decode offered no receive ring for head "
                "slices" if num_layers == len(local) else "")
        raise DirectUnavailable(
            f"{plane}: decode exported {num_layers} layers x {block_bytes} B blocks, this "
            f"worker has {len(local)} x {local[0].shape[1]} B{hint}")


WRITE_SIDES = ("this worker's KV", "decode's KV")
"""How ``check_copy`` names the source and destination of a write from P into D."""
READ_SIDES = ("prefill's KV", "this worker's KV")
"""... and of a read by D from P (``cuda_ipc_reads``)."""


def check_copy(src: KVBounds, dst: KVBounds, layers: Sequence[int], src_blocks: Sequence[int],
               dst_blocks: Sequence[int], sides: tuple[str, str] = WRITE_SIDES) -> int:
    """A whole-block copy of every listed layer's ``src_blocks`` into ``dst_blocks``, checked
    against both sides' KV before anything moves (raises DirectWriteFailed, naming the side
    as ``sides`` does); returns its bytes."""
    if len(src_blocks) != len(dst_blocks):
        raise DirectWriteFailed("src_blocks and dst_blocks differ in length")
    if src.block_bytes != dst.block_bytes:
        raise DirectWriteFailed(f"whole blocks between ranks of different block sizes "
                                f"({src.block_bytes} B in {sides[0]}, {dst.block_bytes} B in "
                                f"{sides[1]})")
    try:
        src.check(layers, src_blocks)
    except BoundsError as e:
        raise DirectWriteFailed(f"{sides[0]}: {e}") from None
    try:
        return dst.check(layers, dst_blocks)
    except BoundsError as e:
        raise DirectWriteFailed(f"{sides[1]}: {e}") from None


def check_staged(local: KVBounds, layers: Sequence[int], src_blocks: Sequence[int],
                 src_head: int, num_heads: int, slot: int, ring_slots: int,
                 ring_slot_bytes: int) -> int:
    """A ring write: a head slice of this worker's KV, gathered and written into slot ``slot``
    of decode's ring, checked before anything moves (raises DirectWriteFailed); returns its
    bytes."""
    try:
        nbytes = local.check(layers, src_blocks, src_head, num_heads)
    except BoundsError as e:
        raise DirectWriteFailed(f"this worker's KV: {e}") from None
    try:
        check_slot(slot, nbytes, ring_slots, ring_slot_bytes)
    except BoundsError as e:
        raise DirectWriteFailed(f"decode granted {e} of its {ring_slots} x {ring_slot_bytes} B "
                                "receive ring") from None
    return nbytes


@dataclass
class StagedWrite:
    """A ring write ``PeerWriter.post_staged`` posted; ``finish_staged`` waits for it."""

    nbytes: int
    pending: Any = None
    """The plane's handle of the posted write (an engine request, a device event); None when
    it is already complete."""


class PeerWriter(ABC):
    """P side: one decode rank's KV, writable from this process. Used by the sender thread
    only."""

    description: str
    """For logs: what the writes go through."""

    @abstractmethod
    def write(self, layers: Sequence[int], src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> int:
        """Write every listed layer's ``src_blocks`` into the peer's ``dst_blocks``; return
        only once the bytes are in the peer's memory. Returns bytes written; raises
        ``DirectWriteFailed`` (or ValueError for bad block ids)."""

    ring_slots: int = 0
    """Slots of the peer's receive ring this writer can reach (0: it cannot write head slices,
    which then go as bytes over the control connection)."""

    host_bounce: bool = False
    """Whole blocks go through the peer's host ring too (``write_staged`` with every head):
    set when ``host_bounce`` is on here and the peer offered its ring in host memory."""

    plane: str = ""
    """The plane's name, sent with each ring write (D may hold a ring per plane)."""

    reads: bool = False
    """D copies the blocks itself from this worker's KV (``cuda_ipc_reads``): the channel sends
    ``DirectRead`` and waits for D's answer instead of calling ``write``."""

    def write_staged(self, local_heads: int, layers: Sequence[int], src_blocks: Sequence[int],
                     src_head: int, num_heads: int, staging: torch.Tensor, slot: int) -> int:
        """Gather a head slice of every (layer, block) into ``staging`` and write it into slot
        ``slot`` of the peer's receive ring; return once it is there. Returns bytes written."""
        return self.finish_staged(self.post_staged(local_heads, layers, src_blocks, src_head,
                                                   num_heads, staging, slot))

    def post_staged(self, local_heads: int, layers: Sequence[int], src_blocks: Sequence[int],
                    src_head: int, num_heads: int, staging: torch.Tensor, slot: int
                    ) -> StagedWrite:
        """``write_staged`` up to posting the write: the bytes are in the ring slot only once
        ``finish_staged`` returned, and until then ``staging`` (and its host twin) must stay
        untouched."""
        raise DirectWriteFailed(f"{type(self).__name__} cannot write head slices")

    def finish_staged(self, write: StagedWrite) -> int:
        """Wait for a posted ring write; returns its bytes (raises DirectWriteFailed)."""
        return write.nbytes

    def staged_done(self, write: StagedWrite) -> bool:
        """Whether ``finish_staged`` would return at once (complete or failed); never blocks."""
        return write.pending is None

    def close(self) -> None:
        """Forget the peer (its channel closed)."""


class PeerReader(ABC):
    """D side: one prefill rank's KV, mapped into this process (``cuda_ipc_reads``). Used by
    that sender's connection thread only."""

    export: DirectExport
    """What D answers the sender with in ``HelloAck.exports``: the plane's export, saying that
    D reads (P then sends ``DirectRead`` for each group)."""

    @abstractmethod
    def read(self, layers: Sequence[int], src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        """Copy every listed layer's ``src_blocks`` of the peer's KV into this worker's
        ``dst_blocks``; return only once the bytes are in this worker's memory. Returns bytes
        copied; raises ``DirectWriteFailed``."""

    def close(self) -> None:
        """Forget the peer (its connection ended)."""


class AddressedExport(Protocol):
    """The export fields of a plane that reaches memory by address (``NixlExport``,
    ``MooncakeExport``)."""

    layer_addrs: list[int]
    num_blocks: int
    block_bytes: int
    ring_addr: int
    ring_slots: int
    ring_slot_bytes: int
    ring_in_host: bool


@dataclass(frozen=True)
class RemoteKV:
    """Where a decode rank's KV is, by address, as its export says: block ``b`` of layer ``l``
    at ``layer_addrs[l] + b * block_bytes``; with a receive ring (different TP, or
    ``host_bounce``), slot ``s`` at ``ring_addr + s * ring_slot_bytes``."""

    layer_addrs: Sequence[int]
    num_blocks: int
    block_bytes: int
    ring_addr: int = 0
    ring_slots: int = 0
    """0: decode offered no ring."""
    ring_slot_bytes: int = 0
    ring_in_host: bool = False
    """The ring is in decode's (pinned) host memory."""

    @classmethod
    def of(cls, export: AddressedExport) -> RemoteKV:
        return cls(layer_addrs=export.layer_addrs, num_blocks=export.num_blocks,
                   block_bytes=export.block_bytes, ring_addr=export.ring_addr,
                   ring_slots=export.ring_slots, ring_slot_bytes=export.ring_slot_bytes,
                   ring_in_host=export.ring_in_host)


class AddressedPeer(PeerWriter):
    """A peer reached by address (NIXL, Mooncake), through ``plane``: both sides' blocks are
    at a layer's base address plus ``block * block_bytes`` (``RemoteKV``). The subclass moves
    bytes; this class checks the request, pairs blocks into runs and gathers head slices."""

    def __init__(self, plane: AddressedPlane, remote: RemoteKV):
        local = plane.local
        if remote.ring_slots and remote.block_bytes != local[0].shape[1]:
            # TP differs: only head slices go, through the ring; the layer count must match
            check_geometry(plane.name, len(remote.layer_addrs), local[0].shape[1], local)
        else:
            check_geometry(plane.name, len(remote.layer_addrs), remote.block_bytes, local)
        self.plane = plane.name
        self.local = local
        self._register_staging = plane.register_staging
        """A staging buffer must be registered before the engine may read it (once per buffer;
        the plane remembers)."""
        self.remote_addrs = list(remote.layer_addrs)
        self.remote_blocks = remote.num_blocks
        self.local_addrs = [t.data_ptr() for t in local]
        self.local_blocks = local[0].shape[0]
        self.block_bytes = remote.block_bytes
        self.local_bounds = KVBounds.of(local)
        self.remote_bounds = KVBounds(len(remote.layer_addrs), remote.num_blocks,
                                      remote.block_bytes)
        """What a write may address on each side: every engine descriptor is computed from
        requests checked against them."""
        self.ring_addr = remote.ring_addr
        self.ring_slots = remote.ring_slots
        self.ring_slot_bytes = remote.ring_slot_bytes
        self.ring_in_host = remote.ring_in_host
        self.host_bounce = plane.host_bounce and remote.ring_slots > 0 and remote.ring_in_host
        if plane.host_bounce and not self.host_bounce:
            logger.warning("LayerKV %s: host_bounce is on here, but decode offered no receive "
                           "ring in host memory (is host_bounce on there?); writing KV memory "
                           "directly", plane.name)
        device = local[0].device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """Where head slices are gathered on a GPU (off vLLM's streams)."""
        self._host_staging = plane.host_staging
        """``host_bounce`` with KV on a GPU: a staging buffer's registered pinned host twin,
        which the engine writes from."""

    def write(self, layers: Sequence[int], src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> int:
        nbytes = check_copy(self.local_bounds, self.remote_bounds, layers, src_blocks,
                            dst_blocks)
        if nbytes:
            self.write_runs(layers, paired_runs(src_blocks, dst_blocks), src_blocks, dst_blocks)
        return nbytes

    def post_staged(self, local_heads: int, layers: Sequence[int], src_blocks: Sequence[int],
                    src_head: int, num_heads: int, staging: torch.Tensor, slot: int
                    ) -> StagedWrite:
        """Gather the head slices into ``staging`` (on the KV's device), then post one write of
        the filled prefix into ring slot ``slot``; with ``host_bounce`` on a GPU, the engine
        writes from a pinned host copy of it (``staging``'s host twin)."""
        local = dataclasses.replace(self.local_bounds, local_heads=local_heads)
        n = check_staged(local, layers, src_blocks, src_head, num_heads, slot, self.ring_slots,
                         self.ring_slot_bytes)
        if not n:
            return StagedWrite(0)
        source = staging
        if self.host_bounce and self._stream is not None:
            try:
                source = self._host_staging(staging)
            except Exception as e:  # noqa: BLE001 - engines raise their own types
                raise DirectWriteFailed(f"{self.plane}: cannot make or register the host "
                                        f"staging buffer: {e}") from None
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    # host_bounce with whole blocks: straight from the KV into host memory on
                    # the copy engine (a gather kernel would wait for SMs the prefill holds)
                    direct = (source is not staging and num_heads == local_heads
                              and copy_block_runs(self.local, layers, src_blocks, source[:n]))
                    if not direct:
                        payload = gather(self.local, layers, src_blocks, src_head, num_heads,
                                         local_heads, staging)
                        if source is not staging:  # host_bounce: the engine reads host memory
                            source[:n].copy_(payload, non_blocking=True)
                self._stream.synchronize()  # the engine reads the buffer from now on
            else:
                gather(self.local, layers, src_blocks, src_head, num_heads, local_heads,
                       staging)
        except (RuntimeError, StagingError) as e:
            raise DirectWriteFailed(f"gathering head slices failed: {e}") from None
        if source is staging:  # a host twin was registered when it was made
            try:
                self._register_staging(staging)
            except Exception as e:  # noqa: BLE001 - engines raise their own types
                raise DirectWriteFailed(f"{self.plane}: cannot register the staging buffer: "
                                        f"{e}") from None
        return StagedWrite(n, self.post_span(source, n,
                                             self.ring_addr + slot * self.ring_slot_bytes))

    def finish_staged(self, write: StagedWrite) -> int:
        if write.pending is not None:
            pending, write.pending = write.pending, None
            self.wait_span(pending)
        return write.nbytes

    def staged_done(self, write: StagedWrite) -> bool:
        return write.pending is None or self.span_done(write.pending)

    @abstractmethod
    def write_runs(self, layers: Sequence[int], runs: list[tuple[int, int, int]],
                   src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Move ``runs`` (src_start, dst_start, length) of every layer in ``layers`` and return
        once they are in the peer's memory (raise DirectWriteFailed otherwise)."""

    @abstractmethod
    def post_span(self, buffer: torch.Tensor, nbytes: int, remote_addr: int) -> Any:
        """Start moving the first ``nbytes`` of ``buffer`` (a staging buffer on the KV's device
        or, with ``host_bounce``, its twin in pinned host memory; already registered) to
        ``remote_addr`` in the peer's ring (in host memory if ``ring_in_host``). Returns what
        ``wait_span`` needs, or None when the bytes are already there (raise
        DirectWriteFailed when the write cannot start)."""

    def wait_span(self, pending: Any) -> None:
        """Return once the write ``post_span`` started is in the peer's memory (raise
        DirectWriteFailed otherwise). Every posted write is waited for, once."""

    def span_done(self, pending: Any) -> bool:
        """Whether ``wait_span`` would return at once (complete or failed); never blocks.
        False when the plane cannot tell without waiting."""
        return False


def layer_geometry(local: Sequence[torch.Tensor]) -> dict[str, object]:
    """The export fields every addressed plane offers: block count, block size, and each
    layer's base address."""
    return {"num_blocks": local[0].shape[0], "block_bytes": local[0].shape[1],
            "layer_addrs": [t.data_ptr() for t in local]}


class DirectPlane(ABC):
    """One worker's direct-write mechanism, both halves. Each plane is registered by name in
    ``wire/planes.py``, which ``create_transport`` builds it from (``check_installed``, then
    ``from_config``)."""

    name: str

    def __init__(self, local: Sequence[torch.Tensor]):
        self.local = list(local)
        """Per layer, this worker's KV as a ``[num_blocks, block_bytes]`` uint8 view."""

    @classmethod
    def check_installed(cls) -> None:
        """Raise DirectUnavailable, naming what to install, when the engine this plane drives
        cannot be imported; called before anything is set up for the plane."""

    @classmethod
    def from_config(cls, local: Sequence[torch.Tensor], config: LayerKVConfig,
                    host_bounce: bool) -> DirectPlane:
        """The plane for a worker with these settings and KV (``local``, as in ``__init__``);
        ``host_bounce``: the setting, resolved for this plane (False unless its registry entry
        takes it). Raises DirectUnavailable when the plane cannot run here."""
        return cls(local)

    @abstractmethod
    def prepare(self) -> None:
        """D side, once at start (before any forward pass): make the KV reachable."""

    @abstractmethod
    def offer(self, hello: Hello, ring: RecvRing | None = None) -> DirectExport | None:
        """D side: the export for this sender, or None if the plane cannot serve it. ``ring``:
        the receive ring for head slices, when the sender's TP differs from this worker's (a
        plane that cannot export it leaves the slices to the byte path)."""

    @abstractmethod
    def attach(self, export: DirectExport) -> PeerWriter:
        """P side: reach a decode rank's KV (raises DirectUnavailable)."""

    def sender_export(self) -> DirectExport | None:
        """P side: this worker's own KV, offered in ``Hello.exports`` to a decode that reads
        it itself; None when the plane has no such path."""
        return None

    def attach_reader(self, hello: Hello, tp_differs: bool) -> PeerReader | None:
        """D side: map the sender's KV to copy each group from it, when this worker reads
        (``cuda_ipc_reads``) and the sender offered its KV; None to let P write."""
        return None

    host_bounce: bool = False
    """Whole blocks too go through D's receive ring in host memory (``AddressedPlane``)."""

    def prepare_ring(self, ring: RecvRing) -> None:
        """D side, at start-up with ``host_bounce``: make ``ring`` reachable before the first
        sender connects (nothing to do for a plane that does not export rings)."""

    def prepare_staging(self, buffers: Sequence[torch.Tensor]) -> None:
        """P side, at start-up with ``host_bounce``: make the sender's staging ``buffers``
        valid write sources before the first request."""

    def shutdown(self) -> None:
        """Release what ``prepare`` / ``attach`` took."""


class AddressedPlane(DirectPlane):
    """A plane whose engine reaches memory by registered address (NIXL, Mooncake). Besides the
    KV cache it registers, once each and on first need, D's receive ring (offered in the export
    to senders with another TP, or to every sender with ``host_bounce``) and P's staging
    buffers (the sender reuses a fixed pool; with ``host_bounce`` also one pinned host
    buffer)."""

    def __init__(self, local: Sequence[torch.Tensor], host_bounce: bool = False):
        super().__init__(local)
        self.host_bounce = host_bounce
        """D: offer a ring in pinned host memory to every sender; P: send whole blocks through
        such a ring (the ``host_bounce`` setting, resolved for this plane)."""
        self._export: DirectExport | None = None
        """Set by ``prepare``: the KV's export, without a ring."""
        self._ring_export: DirectExport | None = None
        self._ring_refused = ""
        """Why the receive ring could not be registered (head slices then go as bytes)."""
        self._lock = threading.Lock()
        """Serialises registrations: D's connection threads, P's sender thread."""
        self._host_twins: dict[int, torch.Tensor] = {}
        """P, ``host_bounce``: staging buffer address -> its registered pinned host twin."""
        self._retired: list[torch.Tensor] = []
        """Outgrown host twins, still registered (see ``host_staging``)."""

    def offer(self, hello: Hello, ring: RecvRing | None = None) -> DirectExport | None:
        """The export; with ``ring`` (the sender's TP differs, or ``host_bounce``) the ring is
        registered the first time (unless ``prepare_ring`` did) and the export carries it."""
        if self._export is None or ring is None:
            return self._export
        self.prepare_ring(ring)
        return self._ring_export or self._export

    def prepare_ring(self, ring: RecvRing) -> None:
        with self._lock:
            if self._ring_export is None and not self._ring_refused:
                try:
                    self.register(ring.tensor)
                except Exception as e:  # noqa: BLE001 - engines raise their own types
                    self._ring_refused = str(e)
                    logger.warning("LayerKV %s: cannot register the receive ring (%s); head "
                                   "slices from prefill ranks with another TP go as bytes, "
                                   "whole blocks straight into the KV", self.name, e)
                else:
                    self._ring_export = self.ring_export(ring)

    def ring_export(self, ring: RecvRing) -> DirectExport:
        """The export with the (registered) ring's address, shape and place."""
        assert self._export is not None
        return msgspec.structs.replace(self._export, ring_addr=ring.tensor.data_ptr(),
                                       ring_slots=ring.slots, ring_slot_bytes=ring.slot_bytes,
                                       ring_in_host=ring.tensor.device.type == "cpu")

    def register_staging(self, buffer: torch.Tensor) -> None:
        """P side: make a staging buffer a valid write source (the first time it is used)."""
        with self._lock:
            self.register(buffer)

    def prepare_staging(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register each buffer, or with the KV on a GPU make its registered host twin."""
        for buf in buffers:
            if buf.device.type == "cuda":
                self.host_staging(buf)
            else:
                self.register_staging(buf)

    def host_staging(self, staging: torch.Tensor) -> torch.Tensor:
        """P side, ``host_bounce`` on a GPU: the pinned host twin of the (GPU) staging buffer
        ``staging``, as long as it and registered with the engine; the engine writes from it.
        A twin per staging buffer, so that every write the sender keeps in flight has its
        own. Twins are the worker's (the sender's staging buffers are fixed), made at start-up
        (``prepare_staging``) or on first use, and kept for the plane's life: a buffer per
        peer would leave a registration behind at every reconnect. Should a larger buffer
        ever come at a known address, its twin replaces the smaller, which stays alive (and
        registered) until shutdown, since an engine registration must not outlive its
        memory."""
        key = staging.data_ptr()
        nbytes = staging.numel() * staging.element_size()
        with self._lock:
            twin = self._host_twins.get(key)
            if twin is None or twin.numel() < nbytes:
                new = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.register(new)
                if twin is not None:
                    self._retired.append(twin)
                self._host_twins[key] = twin = new
            return twin

    @abstractmethod
    def register(self, t: torch.Tensor) -> None:
        """Register ``t``'s bytes with the engine unless already done (the caller holds the
        lock); raise if the engine refuses."""

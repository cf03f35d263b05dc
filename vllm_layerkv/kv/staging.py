"""Head slices of KV blocks through a staging buffer, for prefill and decode with different TP.

When P and D split the KV heads differently (``tp.py``), a decode rank needs only some heads
of each of P's blocks (or P only some of D's). Sent as they are, that is one tiny transfer per
(layer, block, rank): tens of thousands per request. Instead, per layer group and target rank:

* P ``gather``s the route's head slice of every block of the group into one contiguous staging
  buffer (payload order: layer, then block, then the slice's bytes) and sends it in one
  transfer;
* D receives it into a staging buffer of its own and ``scatter``s it into its blocks at the
  route's head offset.

In the HND layout a block is ``[local_heads, block_size, content]``, so a head slice is one
contiguous byte range of each block. On a GPU with Triton both copies are one fused kernel
launch per layer group (``fused_copy``); elsewhere one ``index_select`` / ``index_copy_`` per
layer. Either runs on the KV's device, off the forward path, and only once the request is
checked against the KV's bounds (``bounds.py``).

``StagingPool`` bounds the memory: a fixed number of buffers of a fixed size, reused; a sender
that finds none free waits (bounded by a timeout), so nothing is overwritten before it was
sent, and nothing is allocated per request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch

from vllm_layerkv.kv import fused_copy
from vllm_layerkv.kv.bounds import BoundsError, KVBounds, check_indices, check_slot


class StagingError(RuntimeError):
    """A staging buffer could not be had in time, or a request does not fit one."""


MAX_COPY_RUNS = 8
"""Whole blocks in at most this many runs of adjacent ids are copied run by run (one copy per
layer and run, on the copy engine); more runs go through a gather kernel."""


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs of consecutive ids as half-open (start, end) pairs, in order."""
    it = iter(blocks)
    try:
        start = prev = next(it)
    except StopIteration:
        return
    for b in it:
        if b != prev + 1:
            yield start, prev + 1
            start = b
        prev = b
    yield start, prev + 1


def copy_block_runs(tensors: Sequence[torch.Tensor], layers: Sequence[int],
                    blocks: Sequence[int], out: torch.Tensor) -> bool:
    """Whole ``blocks`` of every layer in ``layers`` into ``out`` in ``gather``'s order, one
    copy per (layer, run of adjacent blocks): a device-to-host ``out`` is filled by the copy
    engine alone, with no kernel competing with the forward pass for the GPU's SMs. False
    (nothing copied) when the blocks are in more than ``MAX_COPY_RUNS`` runs. The caller has
    checked the request against the KV's bounds and ``out``'s size."""
    runs = list(block_runs(blocks))
    if len(runs) > MAX_COPY_RUNS:
        return False
    block_bytes = tensors[0].shape[1]
    offset = 0
    for layer in layers:
        for start, end in runs:
            n = (end - start) * block_bytes
            out[offset:offset + n].copy_(tensors[layer][start:end].view(-1), non_blocking=True)
            offset += n
    return True


def slice_bytes(block_bytes: int, local_heads: int, num_heads: int) -> int:
    if block_bytes % local_heads:
        raise StagingError(f"a {block_bytes} B block does not split into {local_heads} heads")
    return block_bytes // local_heads * num_heads


def pieces(num_layers: int, num_blocks: int, nbytes_per_block: int, limit: int
           ) -> list[tuple[slice, slice]]:
    """Split a (layers x blocks) payload into pieces of at most ``limit`` bytes, as (layer
    range, block range) index slices: whole layers together while they fit, else one layer's
    blocks in runs."""
    if nbytes_per_block > limit:
        raise StagingError(f"one block's slice ({nbytes_per_block} B) exceeds the staging "
                           f"buffer ({limit} B); raise staging_buffer_mb")
    layer_bytes = num_blocks * nbytes_per_block
    if layer_bytes <= limit:
        per = max(1, limit // layer_bytes)
        return [(slice(lo, min(lo + per, num_layers)), slice(0, num_blocks))
                for lo in range(0, num_layers, per)]
    per_blocks = limit // nbytes_per_block
    return [(slice(layer, layer + 1), slice(lo, min(lo + per_blocks, num_blocks)))
            for layer in range(num_layers) for lo in range(0, num_blocks, per_blocks)]


def _slice_geometry(tensors: Sequence[torch.Tensor], local_heads: int, num_heads: int
                    ) -> tuple[int, int]:
    """(bytes of a ``num_heads`` slice of one block, bytes of one head)."""
    if num_heads < 1:
        raise BoundsError(f"a head slice of {num_heads} heads")
    nbytes = slice_bytes(tensors[0].shape[1], local_heads, num_heads)
    return nbytes, nbytes // num_heads


def _heads_view(t: torch.Tensor, local_heads: int) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 -> ``[num_blocks, local_heads, head_bytes]``."""
    return t.view(t.shape[0], local_heads, t.shape[1] // local_heads)


def gather(tensors: Sequence[torch.Tensor], layers: Sequence[int], blocks: Sequence[int],
           first_head: int, num_heads: int, local_heads: int, out: torch.Tensor) -> torch.Tensor:
    """Copy heads ``[first_head, first_head + num_heads)`` of ``blocks`` of every layer in
    ``layers`` into ``out`` (uint8, on the KV's device); returns the filled prefix of ``out``.
    ``tensors[layer]`` is a layer's KV as ``[num_blocks, block_bytes]`` uint8. Raises
    BoundsError (nothing copied) for a layer, block or head outside the KV."""
    nbytes, head_bytes = _slice_geometry(tensors, local_heads, num_heads)
    total = KVBounds.of(tensors, local_heads).check(layers, blocks, first_head, num_heads)
    if total > out.numel():
        raise StagingError(f"{total} B of head slices do not fit a {out.numel()} B buffer")
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=tensors[0].device)
    if fused_copy.copy_slices(tensors, layers, idx, first_head * head_bytes, nbytes, out,
                              to_buf=True):
        return out[:total]
    dst = out[:total].view(len(layers), len(blocks), num_heads, head_bytes)
    for i, layer in enumerate(layers):
        src = _heads_view(tensors[layer], local_heads)[:, first_head:first_head + num_heads]
        torch.index_select(src, 0, idx, out=dst[i])
    return out[:total]


def scatter(payload: torch.Tensor, tensors: Sequence[torch.Tensor], layers: Sequence[int],
            blocks: Sequence[int], first_head: int, num_heads: int, local_heads: int) -> None:
    """The inverse of ``gather``: write ``payload`` (gather's order) into heads
    ``[first_head, first_head + num_heads)`` of ``blocks`` of every layer in ``layers``.
    Checked before anything is written: a layer, block or head outside the KV raises
    BoundsError, a payload of another size StagingError."""
    nbytes, head_bytes = _slice_geometry(tensors, local_heads, num_heads)
    total = KVBounds.of(tensors, local_heads).check(layers, blocks, first_head, num_heads)
    if payload.numel() != total:
        raise StagingError(f"payload of {payload.numel()} B is not {len(layers)} layers x "
                           f"{len(blocks)} blocks x {nbytes} B")
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=tensors[0].device)
    if fused_copy.copy_slices(tensors, layers, idx, first_head * head_bytes, nbytes, payload,
                              to_buf=False):
        return
    src = payload.view(len(layers), len(blocks), num_heads, head_bytes)
    for i, layer in enumerate(layers):
        dst = _heads_view(tensors[layer], local_heads)[:, first_head:first_head + num_heads]
        # dst is a strided view of the cache: index_copy_ on it writes through to the cache
        dst.index_copy_(0, idx, src[i])


class StagingPool:
    """``count`` reusable buffers of ``buffer_bytes`` each, allocated once on ``device``."""

    def __init__(self, count: int, buffer_bytes: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False):
        if count < 1 or buffer_bytes < 1:
            raise StagingError("a staging pool needs at least one buffer of at least one byte")
        self.buffer_bytes = buffer_bytes
        self.buffers = tuple(torch.empty(buffer_bytes, dtype=torch.uint8, device=device,
                                         pin_memory=pin_memory) for _ in range(count))
        """Every buffer, free or not (to register them with an engine once)."""
        self._free = list(self.buffers)
        self._cond = threading.Condition()
        self.waits = 0
        """How often an acquire found no free buffer (back-pressure, for stats)."""

    def acquire(self, nbytes: int, timeout: float) -> torch.Tensor:
        """A free buffer of at least ``nbytes``; waits up to ``timeout`` s for one to be
        released, then raises StagingError (the caller fails the transfer, it never
        overwrites a buffer still in use)."""
        if nbytes > self.buffer_bytes:
            raise StagingError(f"{nbytes} B exceed the staging buffer size of "
                               f"{self.buffer_bytes} B; send fewer layers or blocks at once")
        with self._cond:
            if not self._free:
                self.waits += 1
                if not self._cond.wait_for(lambda: bool(self._free), timeout):
                    raise StagingError(f"no staging buffer was released within {timeout:.1f} s")
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)


class RecvRing:
    """D side: ``slots`` receive slots of ``slot_bytes`` in one tensor, for direct planes that
    write through it (one export, addressed by slot): on the KV's device for head slices, in
    pinned host memory for ``host_bounce``. D grants a free slot per write and frees it only
    after scattering the slot into its blocks, so P never writes over bytes not yet scattered;
    with every slot busy, the grant waits (back-pressure)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device | str,
                 pin_memory: bool = False):
        if slots < 1 or slot_bytes < 1:
            raise StagingError("a receive ring needs at least one slot of at least one byte")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.tensor = torch.empty(slots, slot_bytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin_memory)
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.waits = 0
        """How often a write found no free slot (back-pressure, for stats)."""

    def acquire(self, nbytes: int, timeout: float) -> int:
        slot = self.try_acquire(nbytes, timeout)
        if slot is None:
            raise StagingError(f"no receive-ring slot was freed within {timeout:.1f} s")
        return slot

    def check_fits(self, nbytes: int) -> None:
        """Raise StagingError, saying what to change, when ``nbytes`` cannot fit a slot."""
        if nbytes < 0:
            raise StagingError(f"a write of {nbytes} B into the receive ring")
        if nbytes > self.slot_bytes:
            raise StagingError(f"{nbytes} B exceed the receive-ring slot of {self.slot_bytes} B;"
                               " give prefill a staging_buffer_mb no larger than decode's")

    def try_acquire(self, nbytes: int, timeout: float = 0.0) -> int | None:
        """A free slot, waiting up to ``timeout`` s for one; None if none was freed. Raises
        StagingError when ``nbytes`` cannot fit a slot at all."""
        self.check_fits(nbytes)
        with self._cond:
            if not self._free:
                if not timeout:
                    return None
                self.waits += 1
                if not self._cond.wait_for(lambda: bool(self._free), timeout):
                    return None
            return self._free.pop()

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``slot`` (BoundsError outside the ring)."""
        check_slot(slot, nbytes, self.slots, self.slot_bytes)
        return self.tensor[slot, :nbytes]

    def release(self, slot: int) -> None:
        check_indices("receive-ring slot", [slot], self.slots)  # never grant a slot past the end
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify()

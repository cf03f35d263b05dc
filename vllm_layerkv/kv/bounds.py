"""Bounds of every write into KV memory and receive rings, checked before anything is written.

Block ids, layer indices, head ranges, ring slots and byte counts come from messages (a
peer's ``BlockData`` / ``DirectWrite``, a decode's ``WriteGrant``) or from a plane's export.
Nothing that copies KV relies on them being in range: a torch slice past the end silently
copies less, a negative index wraps to the other end, and on a GPU a copy kernel or an engine
descriptor writes wherever the arithmetic points. So every path that writes (the TCP
receiver's ``BlockIO``, ``staging.gather`` / ``scatter`` and the fused kernel behind them, the
receive ring, and each direct plane's writer) checks its request here first and raises
``BoundsError``, which fails that transfer, before it copies a byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BoundsError(ValueError):
    """A write would reach outside the memory it is meant for; nothing was written. The
    message names the index or range that is out of bounds."""


def check_indices(what: str, values: Sequence[int], count: int) -> None:
    """Every one of ``values`` must be in ``0..count-1``."""
    if values and (min(values) < 0 or max(values) >= count):
        bad = [v for v in values if not 0 <= v < count]
        raise BoundsError(f"{what} {bad[:8]} outside 0..{count - 1}")


def check_span(what: str, offset: int, nbytes: int, size: int) -> None:
    """Bytes ``[offset, offset + nbytes)`` must lie within a region of ``size`` bytes."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise BoundsError(f"{what}: bytes [{offset}, {offset + nbytes}) outside the {size} B "
                          "region")


def check_slot(slot: int, nbytes: int, slots: int, slot_bytes: int) -> None:
    """A write of ``nbytes`` into slot ``slot`` of a ring of ``slots`` x ``slot_bytes``."""
    check_indices("receive-ring slot", [slot], slots)
    check_span(f"receive-ring slot {slot}", 0, nbytes, slot_bytes)


@dataclass(frozen=True)
class KVBounds:
    """One worker's KV as writes address it: ``num_layers`` layers of ``num_blocks`` blocks of
    ``block_bytes``, each block holding ``local_heads`` KV heads (a head slice is one
    contiguous range of each block, ``staging.py``)."""

    num_layers: int
    num_blocks: int
    block_bytes: int
    local_heads: int = 1

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], local_heads: int = 1) -> KVBounds:
        """Of per-layer ``[num_blocks, block_bytes]`` views (every layer the same shape)."""
        return cls(len(tensors), tensors[0].shape[0], tensors[0].shape[1], local_heads)

    def check(self, layers: Sequence[int], blocks: Sequence[int], first_head: int = 0,
              num_heads: int = 0) -> int:
        """Check a write of every listed layer's ``blocks`` (``num_heads`` > 0: only heads
        ``[first_head, first_head + num_heads)`` of each); returns its payload bytes."""
        check_indices("layers", layers, self.num_layers)
        check_indices("block ids", blocks, self.num_blocks)
        return len(layers) * len(blocks) * self.slice_bytes(first_head, num_heads)

    def slice_bytes(self, first_head: int = 0, num_heads: int = 0) -> int:
        """Bytes per block of a write of heads ``[first_head, first_head + num_heads)``
        (``num_heads`` 0: the whole block)."""
        if not num_heads:
            if first_head:
                raise BoundsError(f"first_head {first_head} without num_heads")
            return self.block_bytes
        if num_heads < 0 or first_head < 0 or first_head + num_heads > self.local_heads:
            raise BoundsError(f"heads [{first_head}, {first_head + num_heads}) outside this "
                              f"rank's {self.local_heads}")
        if self.block_bytes % self.local_heads:
            raise BoundsError(f"a {self.block_bytes} B block does not split into "
                              f"{self.local_heads} heads")
        return self.block_bytes // self.local_heads * num_heads

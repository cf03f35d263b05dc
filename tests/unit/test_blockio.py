"""``kv/blockio.py`` on CPU: how ``StagedBlockIO`` cuts a frame into pieces (``frame_pieces``)
and how it copies a piece's rows between a host half and the blocks (``_copy_rows``), for
blocks copied run by run and for scattered blocks (the index kernel's path). The copies
themselves run on a GPU in ``tests/gpu/test_blockio_gpu.py``; the row arithmetic is the same
on any device, so it is checked here against plain indexing."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_layerkv.kv.blockio import EDGE_BYTES, StagedBlockIO, frame_pieces


def covered(pieces: list[tuple[int, int, int]], layers: int, rows: int) -> bool:
    """The pieces, in order, are every layer's rows once each, in payload order."""
    flat = [(i, r) for i, first, end in pieces for r in range(first, end)]
    return flat == [(i, r) for i in range(layers) for r in range(rows)]


def test_a_layer_is_a_piece_when_it_fits_the_edge() -> None:
    assert frame_pieces(3, 4, 1 << 20, "first") == [(0, 0, 4), (1, 0, 4), (2, 0, 4)]
    assert frame_pieces(1, 128, 64 << 10, "last") == [(0, 0, 128)]  # exactly 8 MiB
    assert frame_pieces(0, 10, 64 << 10, "first") == []


def test_reading_cuts_the_first_layer_and_writing_the_last() -> None:
    rows, row_bytes = 512, 64 << 10  # a layer of 8,192 tokens of Llama-3.1-8B: 32 MiB
    cut = EDGE_BYTES // row_bytes
    assert frame_pieces(2, rows, row_bytes, "first") == [
        (0, 0, cut), (0, cut, rows), (1, 0, rows)]
    assert frame_pieces(2, rows, row_bytes, "last") == [
        (0, 0, rows), (1, 0, rows - cut), (1, rows - cut, rows)]
    assert frame_pieces(1, rows, row_bytes, "first")[0] == (0, 0, cut)
    assert frame_pieces(1, rows, row_bytes, "last")[-1] == (0, rows - cut, rows)


@pytest.mark.parametrize("edge", ["first", "last"])
def test_the_pieces_are_the_payload_in_order(edge: str) -> None:
    rng = random.Random(0)
    for _ in range(200):
        layers, rows = rng.randint(1, 6), rng.randint(0, 300)
        row_bytes, edge_bytes = rng.choice([1, 4096, 64 << 10]), rng.randint(1, 1 << 21)
        pieces = frame_pieces(layers, rows, row_bytes, edge, edge_bytes)
        assert covered(pieces, layers, rows), (layers, rows, row_bytes, edge_bytes)
        at_edge = pieces[0] if edge == "first" else pieces[-1]
        assert at_edge[2] - at_edge[1] <= max(1, edge_bytes // row_bytes)


def test_a_block_larger_than_the_edge_is_one_row_at_the_edge() -> None:
    assert frame_pieces(1, 3, 16 << 20, "first") == [(0, 0, 1), (0, 1, 3)]


def test_an_edge_that_is_neither_end_is_refused() -> None:
    with pytest.raises(ValueError, match="'first' or 'last'"):
        frame_pieces(2, 4, 8, "middle")


def staged_on_cpu() -> StagedBlockIO:
    """A ``StagedBlockIO`` without its CUDA state, for its row copies alone (CPU tensors)."""
    io = StagedBlockIO.__new__(StagedBlockIO)
    io._device = torch.device("cpu")
    return io


@pytest.mark.parametrize("blocks", [
    list(range(10, 42)),                                  # one run
    [*range(8), *range(50, 60), *range(70, 75)],          # three runs, copied run by run
    random.Random(1).sample(range(96), 40),               # scattered: the index path
])
def test_a_pieces_rows_go_to_and_from_the_right_blocks(blocks: list[int]) -> None:
    io = staged_on_cpu()
    kv = torch.randint(0, 256, (96, 16), dtype=torch.uint8)
    plan = io._copy_plan(blocks)
    assert isinstance(plan, torch.Tensor) == (len(blocks) == 40)
    rows = len(blocks)
    for first, end in [(0, rows), (0, 5), (5, rows), (3, 4), (9, 23), (rows - 1, rows)]:
        host = torch.zeros(rows, 16, dtype=torch.uint8)
        io._copy_rows(host, kv, plan, (first, end), to_host=True)
        want = torch.zeros(rows, 16, dtype=torch.uint8)
        want[first:end] = kv[blocks[first:end]]
        assert torch.equal(host, want), (first, end)

        into = torch.zeros_like(kv)
        source = torch.randint(0, 256, (rows, 16), dtype=torch.uint8)
        io._copy_rows(source, into, plan, (first, end), to_host=False)
        expected = torch.zeros_like(kv)
        expected[blocks[first:end]] = source[first:end]
        assert torch.equal(into, expected), (first, end)

"""``StagedBlockIO`` on a GPU: the two-half pipeline (the device copy of one piece runs while the
caller sends or receives the other) moves every byte of every layer to and from the right
blocks, for block lists in one run, in a few runs (copied run by run) and scattered (gathered
and scattered by an index kernel), with the frame's edge layer whole and cut
(``frame_pieces``), and a write the caller gave up on leaves the next one exact.
Skipped without CUDA (CI); on a GPU host it also runs as a script, where pytest is not
installed.
"""

from __future__ import annotations

import random
import sys

import torch
from gpu_skip import run_as_script

try:
    import pytest
except ImportError:  # the GPU image has no pytest: run this file as a script (bottom)
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_BLOCKS, LAYERS = 96, 5

BLOCK_LISTS = {
    "one run": list(range(10, 42)),
    "three runs": [*range(8), *range(50, 60), *range(70, 75)],
    "scattered": random.Random(0).sample(range(NUM_BLOCKS), 40),
}


def make_io():
    from vllm_layerkv.kv.blockio import StagedBlockIO
    from vllm_layerkv.kv.layout import KVLayout

    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(
        (NUM_BLOCKS, 2, 16, 256), dtype=torch.uint8, device="cuda") for i in range(LAYERS)}
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS)
    return StagedBlockIO(layout), layout


def payload(layers: int, blocks: int, block_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layers, blocks, block_bytes), dtype=torch.uint8,
                         generator=gen)


def fill(bufs, data: torch.Tensor) -> int:
    """Fill the buffers a write hands out, in order, with ``data``'s bytes; how many there
    were."""
    flat, at, n = data.numpy().tobytes(), 0, 0
    for n, buf in enumerate(bufs, 1):
        buf[:] = flat[at:at + len(buf)]
        at += len(buf)
    assert at == len(flat)
    return n


def round_trip(io, layout, edge_bytes: int) -> None:
    io.edge_bytes = edge_bytes
    for seed, (name, ids) in enumerate(BLOCK_LISTS.items()):
        layers = [0, 1, 2, 3, 4] if seed % 2 == 0 else [4, 2, 0]
        data = payload(len(layers), len(ids), layout.block_bytes, seed)
        before = [t.clone() for t in layout.block_tensors()]
        cut = edge_bytes < len(ids) * layout.block_bytes
        assert fill(io.write(layers, ids), data) == len(layers) + cut, name
        for i, layer in enumerate(layers):  # the blocks hold what was written, nothing else
            got = layout.block_tensors()[layer]
            assert torch.equal(got[ids].cpu(), data[i]), (name, layer)
            others = [b for b in range(NUM_BLOCKS) if b not in set(ids)]
            assert torch.equal(got[others], before[layer][others]), (name, layer)
        # reading hands out each piece once its own copy is done, not the other half's
        sent = [bytes(buf) for buf in io.read(layers, ids)]
        assert len(sent) == len(layers) + cut, name
        assert b"".join(sent) == data.numpy().tobytes(), name


def test_every_layer_round_trips_through_the_two_halves() -> None:
    io, layout = make_io()
    round_trip(io, layout, edge_bytes=1 << 30)


def test_the_edge_layer_cut_in_two_round_trips_as_well() -> None:
    io, layout = make_io()
    round_trip(io, layout, edge_bytes=3 * 8192)  # three blocks: a piece of a run, of the index


def test_a_write_given_up_midway_leaves_the_next_one_exact() -> None:
    io, layout = make_io()
    ids = BLOCK_LISTS["three runs"]
    first = payload(LAYERS, len(ids), layout.block_bytes, 10)
    writes = io.write(list(range(LAYERS)), ids)
    for i in range(3):  # the connection dropped while layer 2 was arriving
        buf = next(writes)
        buf[:] = first[i].numpy().tobytes()
    writes.close()
    second = payload(LAYERS, len(ids), layout.block_bytes, 11)
    fill(io.write(list(range(LAYERS)), ids), second)
    for layer in range(LAYERS):
        assert torch.equal(layout.block_tensors()[layer][ids].cpu(), second[layer]), layer


if __name__ == "__main__":
    failed = run_as_script(globals())
    sys.exit(1 if failed else 0)

"""Bounds checks of the GPU write paths: the fused Triton copy behind ``staging.gather`` /
``scatter`` (D's ring scatter, P's gathers) and ``StagedBlockIO`` (bytes over TCP into GPU
KV). A request outside the KV is refused before any kernel or copy runs, every cache byte is
unchanged, and an honest request after it lands byte exact. Skipped without CUDA (CI); on a GPU
host it also runs as a script, where pytest is not installed.
"""

from __future__ import annotations

import sys

import torch
from gpu_skip import run_as_script

try:
    import pytest
except ImportError:  # the GPU image has no pytest: run this file as a script (bottom)
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

POISON = 0x5A


def refused(fn, *args) -> str:
    """Call ``fn``; it must raise BoundsError. Returns the message."""
    from vllm_layerkv.kv.bounds import BoundsError

    try:
        fn(*args)
    except BoundsError as e:
        return str(e)
    raise AssertionError(f"{fn.__name__}{args[2:5]} was not refused")


def test_fused_copy_refuses_requests_outside_the_kv_before_launching() -> None:
    from vllm_layerkv.kv import fused_copy, staging

    assert fused_copy.available(torch.device("cuda")), "Triton is not importable here"
    heads, head_bytes, layers, blocks = 4, 2048, 3, 64
    caches = [torch.randint(0, 256, (blocks, heads * head_bytes), dtype=torch.uint8,
                            device="cuda") for _ in range(layers)]
    before = [c.clone() for c in caches]
    payload = torch.full((2 * head_bytes,), POISON, dtype=torch.uint8, device="cuda")
    for layer_ids, block_ids, first, count in (
            ([0], [blocks], 0, 1), ([0], [-1], 0, 1), ([layers], [0], 0, 1),
            ([0], [0], heads, 1), ([0], [0], -1, 1), ([0], [0], 3, 2), ([0], [1, 2], 0, 0)):
        refused(staging.scatter, payload[:len(block_ids) * count * head_bytes] if count > 0
                else payload[:0], caches, layer_ids, block_ids, first, count, heads)
        refused(staging.gather, caches, layer_ids, block_ids, first, count, heads,
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    refused(fused_copy.copy_slices, caches, [0], torch.tensor([0], device="cuda"),
            heads * head_bytes - 8, 16, payload, False)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    staging.scatter(payload, caches, [2], [9, 40], 3, 1, heads)  # the honest one
    torch.cuda.synchronize()
    for i in range(layers):
        want = before[i].clone().view(blocks, heads, head_bytes)
        if i == 2:
            want[[9, 40], 3] = POISON
        assert torch.equal(caches[i].view(blocks, heads, head_bytes), want), i
    assert not fused_copy._broken


def test_staged_block_io_refuses_requests_outside_the_kv_and_round_trips() -> None:
    from vllm_layerkv.kv.blockio import StagedBlockIO
    from vllm_layerkv.kv.layout import KVLayout

    blocks, content = 32, 128
    caches = {f"model.layers.{i}.self_attn.attn": torch.full(
        (blocks, 2, 16, content), POISON, dtype=torch.uint8, device="cuda") for i in range(4)}
    layout = KVLayout.from_kv_caches(caches, blocks)
    io = StagedBlockIO(layout, local_heads=2)
    before = [t.clone() for t in layout.block_tensors()]
    for layers, ids in (([0], [blocks]), ([0], [-1]), ([4], [0]), ([-1], [0])):
        refused(lambda: next(io.write(layers, ids)))
        refused(io.read, layers, ids)
    refused(lambda: next(io.write_slices([0], [1], 1, 2)))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(layout.block_tensors(), before))
    data = torch.randint(0, 256, (2, 2, layout.block_bytes), dtype=torch.uint8)
    for i, buf in enumerate(io.write([0, 2], [3, 4])):
        buf[:] = data[i].numpy().tobytes()
    got = [bytes(b) for b in io.read([0, 2], [3, 4])]
    assert got == [data[i].numpy().tobytes() for i in range(2)]
    changed = [(layer, b) for layer, t in enumerate(layout.block_tensors())
               for b in range(blocks) if not torch.equal(t[b], before[layer][b])]
    assert changed == [(0, 3), (0, 4), (2, 3), (2, 4)]


if __name__ == "__main__":
    failed = run_as_script(globals())
    sys.exit(1 if failed else 0)

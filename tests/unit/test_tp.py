"""TP mapping (tp.py): for every layout vLLM can produce, the routes deliver to each decode rank
exactly the heads it holds, each head once, from a prefill rank that holds it. Checked by
moving real data: a model's KV heads are split as vLLM splits them on P and on D, P's slices
are copied along the routes into poisoned D buffers, and every D element is compared."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from vllm_layerkv.kv import tp
from vllm_layerkv.wire.protocol import CompatInfo

HEAD_ELEMS = 6  # stand-in for block_size x content of one head inside a block


def split(global_kv: torch.Tensor, rank: int, tp_size: int, heads: int,
          replicated: bool) -> torch.Tensor:
    first, count = tp.rank_heads(rank, tp_size, heads, replicated)
    return global_kv[:, first:first + count].clone()


def layouts():
    for heads, p_tp, d_tp in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8]):
        yield heads, p_tp, d_tp, False
    for heads, p_tp, d_tp in itertools.product([1], [1, 2, 4], [1, 2, 4]):
        yield heads, p_tp, d_tp, True  # MLA-like: every rank holds the whole cache


@pytest.mark.parametrize("heads, p_tp, d_tp, replicated", list(layouts()))
def test_routes_deliver_every_head_exactly_once(heads, p_tp, d_tp, replicated) -> None:
    blocks = 5
    gen = torch.Generator().manual_seed(heads * 100 + p_tp * 10 + d_tp)
    global_kv = torch.randn(blocks, heads, HEAD_ELEMS, generator=gen)
    p_local = [split(global_kv, r, p_tp, heads, replicated) for r in range(p_tp)]
    d_local = [torch.full_like(split(global_kv, d, d_tp, heads, replicated), float("nan"))
               for d in range(d_tp)]
    writes = [torch.zeros(d.shape[1], dtype=torch.int64) for d in d_local]
    senders: dict[int, set[int]] = {d: set() for d in range(d_tp)}
    for p in range(p_tp):
        for r in tp.routes(p, p_tp, d_tp, heads, replicated):
            src = p_local[p][:, r.src_head:r.src_head + r.num_heads]
            d_local[r.d_rank][:, r.dst_head:r.dst_head + r.num_heads] = src
            writes[r.d_rank][r.dst_head:r.dst_head + r.num_heads] += 1
            senders[r.d_rank].add(p)
            whole = r.num_heads == p_local[p].shape[1] == d_local[r.d_rank].shape[1]
            assert r.whole_block == whole
    for d in range(d_tp):
        assert torch.equal(d_local[d], split(global_kv, d, d_tp, heads, replicated)), d
        assert (writes[d] == 1).all(), f"D rank {d} heads written {writes[d].tolist()}"
        assert sorted(senders[d]) == tp.source_ranks(d, d_tp, p_tp, heads, replicated)


def test_equal_tp_is_whole_blocks_rank_to_rank() -> None:
    for size in (1, 2, 4, 8):
        for r in range(size):
            assert tp.routes(r, size, size, 8) == [tp.Route(r, 0, 0, 8 // size, True)]


def test_replicas_spread_over_decode_ranks() -> None:
    """P TP4 with 2 KV heads: ranks (0, 1) hold head 0 and (2, 3) head 1. D TP1 needs both from
    one replica each; with D TP2 each D rank reads a different replica."""
    to_d1 = {p: tp.routes(p, 4, 1, 2) for p in range(4)}
    assert [p for p, rs in to_d1.items() if rs] == [0, 2]
    assert tp.source_ranks(0, 1, 4, 2) == [0, 2]


@pytest.mark.parametrize("p_tp, d_tp, heads, side", [
    (3, 1, 8, "prefill"), (1, 3, 8, "decode"), (4, 2, 3, "prefill"), (2, 6, 4, "decode")])
def test_impossible_layouts_fail_with_the_side_named(p_tp, d_tp, heads, side) -> None:
    with pytest.raises(tp.TPMismatchError, match=side):
        tp.routes(0, p_tp, d_tp, heads)


def compat(tp_size: int, total_heads: int = 8, groups: tuple[str, ...] = ("full:4x16",),
           head_bytes: int = 1024) -> CompatInfo:
    """What a rank of a TP ``tp_size`` instance reports (per-rank heads and block bytes)."""
    local = max(1, total_heads // tp_size)
    return CompatInfo(vllm_version="0.32.0", model="m", dtype="float32", kv_layout="HND",
                      block_size=16, num_kv_heads=local, head_size=64, num_layers=4,
                      block_bytes=local * head_bytes, total_kv_heads=total_heads,
                      kv_groups=list(groups))


def test_equal_tp_compares_everything() -> None:
    assert tp.peer_error(compat(2), 2, compat(2), 2, "decode d") is None
    other = msgspec.structs.replace(compat(2), block_size=32)
    assert "block_size" in tp.peer_error(compat(2), 2, other, 2, "decode d")


@pytest.mark.parametrize("p_tp, d_tp, heads", [(2, 1, 8), (1, 2, 8), (4, 2, 2), (2, 4, 2)])
def test_different_tp_compares_per_head(p_tp, d_tp, heads) -> None:
    assert tp.peer_error(compat(p_tp, heads), p_tp, compat(d_tp, heads), d_tp, "d") is None
    other_head = compat(d_tp, heads, head_bytes=2048)
    assert "block_bytes" in tp.peer_error(compat(p_tp, heads), p_tp, other_head, d_tp, "d")


def test_different_tp_refusals_say_why() -> None:
    hybrid = ("mamba:5x64", "full:4x16")
    err = tp.peer_error(compat(2, groups=hybrid), 2, compat(1, groups=hybrid), 1, "decode d")
    assert "Mamba" in err and "same tensor_parallel_size" in err
    err = tp.peer_error(compat(3, 8), 3, compat(1, 8), 1, "decode d")
    assert "does not divide" in err
    old = msgspec.structs.replace(compat(1), total_kv_heads=0)
    assert "upgrade" in tp.peer_error(compat(2), 2, old, 1, "decode d")
    assert tp.source_ranks(1, 2, 2, 8) == [1]

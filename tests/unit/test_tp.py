"""TP mapping (tp.py): for every layout vLLM can produce, the routes deliver to each decode rank
exactly the heads it holds, each head once, from a prefill rank that holds it. Checked by
moving real data: a model's KV heads are split as vLLM splits them on P and on D, P's slices
are copied along the routes into poisoned D buffers, and every D element is compared."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_layerkv import tp

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
            assert r.whole_block == (r.num_heads == p_local[p].shape[1] == d_local[r.d_rank].shape[1])
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


def test_the_whole_block_data_path_still_refuses_unequal_tp() -> None:
    with pytest.raises(tp.TPMismatchError, match="same tensor_parallel_size"):
        tp.check_supported(2, 1)
    assert tp.source_ranks(1, 2, 2) == [1]

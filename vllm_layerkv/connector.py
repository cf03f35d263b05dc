"""``LayerKVConnector``: the class vLLM instantiates. A facade only: every call is delegated to
the scheduler half (engine-core process) or the worker half (each worker process).

Use::

    vllm serve MODEL --kv-transfer-config \
        '{"kv_connector":"LayerKV","kv_role":"kv_producer","kv_connector_extra_config":{...}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.compat import (
    HAS_TRANSFER_RESULTS,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    make_transfer_results,
)
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.metadata import LayerKVHandshake, LayerKVMetadata
from vllm_layerkv.scheduler.scheduler import LayerKVScheduler
from vllm_layerkv.stats import LayerKVPromMetrics, LayerKVStats
from vllm_layerkv.worker.worker import LayerKVWorker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class LayerKVConnector(KVConnectorBase_V1, SupportsHMA):
    # Signatures follow KVConnectorBase_V1's; its dict[str, Any] holds JSON-like values
    # (kv_connector_extra_config, stats data, a response's kv_transfer_params).

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class refuses a config without one
        self._config = LayerKVConfig.from_extra_config(ktc.kv_connector_extra_config)
        is_producer, is_consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self._num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self._scheduler: LayerKVScheduler | None = None
        self._worker: LayerKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = LayerKVScheduler(vllm_config, kv_cache_config, self._config,
                                               is_producer, is_consumer)
        else:
            self._worker = LayerKVWorker(vllm_config, kv_cache_config, self._config,
                                         is_producer, is_consumer)

    # ------------------------------------------------------------------ class-level hooks
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # HND (= LBHNC): block dimension outermost, a block is one contiguous run per layer.
        return "HND"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Only vLLM's extra_config is visible here, not kv_role: the prefill launch marks itself
        # with "piecewise_cudagraph": true so that decode keeps its FULL decode graphs.
        return LayerKVConfig.from_extra_config(extra_config).piecewise_cudagraph

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM 0.33+ asks before sleep mode. LayerKV registers its KV tensors once (CUDA IPC
        # handles, NIXL / Mooncake memory registrations, D's exports to P): memory freed and
        # re-allocated by sleep / wake-up would leave peers writing into stale addresses.
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LayerKVStats:
        return LayerKVStats(data=data) if data is not None else LayerKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> LayerKVPromMetrics:
        return LayerKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> LayerKVHandshake | None:
        return self._worker.get_handshake_metadata() if self._worker else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, LayerKVMetadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Push design: decode never pulls; KV lands in its blocks before the request runs.
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.on_layer_saved(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM 0.26 path (0.32+ calls get_transfer_results). It has no request-level failure
        # report, so a failed request is reported finished here and its blocks as load errors
        # in the same step (get_block_ids_with_load_errors), which applies vLLM's
        # kv_load_failure_policy (fail or recompute). 0.26 handles that for one KV cache group,
        # which is all this version supports.
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return (sending or None), ((recving | failed) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # 0.32+: failures travel as failed_recving, except for requests reported early (they
        # run already), which every version learns of through their blocks
        if self._worker is None:
            return set()
        return self._worker.failed_blocks(request_failures=not HAS_TRANSFER_RESULTS)

    if HAS_TRANSFER_RESULTS:

        def get_transfer_results(self, finished_req_ids: set[str]
                                 ) -> KVConnectorTransferResults:
            assert self._worker is not None
            sending, recving, failed = self._worker.transfer_results()
            return make_transfer_results(sending, recving, failed)

    def get_kv_connector_stats(self) -> LayerKVStats | None:
        if self._worker is not None:
            return self._worker.stats()
        return self._scheduler.stats() if self._scheduler is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake_metadata(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # Everything LayerKV writes must not be zeroed by vLLM under or after the write.
        return tuple(range(self._num_kv_cache_groups))

"""Worker half of the connector: one per GPU/CPU worker process.

Owns the KV layout (from ``register_kv_caches``), the transport, and the role-specific parts:
``PrefillWorker`` + ``Sender`` thread on a producer, ``DecodeWorker`` (+ transport receiver
threads) on a consumer, both on ``kv_both``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_layerkv.common.backoff import Backoff
from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import set_switch_interval
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.compat import device_type, kv_groups, tp_rank_and_size
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.blockio import block_io_for
from vllm_layerkv.kv.layout import KVLayout, LayoutError, compat_info
from vllm_layerkv.metadata import LayerKVHandshake, LayerKVMetadata
from vllm_layerkv.stats import LayerKVStats
from vllm_layerkv.transport import Transport, create_transport
from vllm_layerkv.wire.protocol import Hello
from vllm_layerkv.worker.decode import DecodeWorker, early_release_applies
from vllm_layerkv.worker.prefill import PrefillWorker
from vllm_layerkv.worker.sender import Sender, SenderParts, SenderTuning

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)
IDLE_WAIT_S = 0.002
IDLE_WAIT_MAX_S = 0.05
"""On a step with nothing scheduled while transfers are in flight, wait for a completion instead
of returning at once: IDLE_WAIT_S, doubling on each further idle step that ends without one, up
to IDLE_WAIT_MAX_S (back to IDLE_WAIT_S after a completion or a step with work). vLLM's engine
loop steps continuously while requests wait for KV or acknowledgements, and its workers
busy-poll their message queue between steps: with 2 ms waits a worker still spun half the time,
which on a small CPU host starved the other instance's worker pinned to the same core (the one
this side was waiting for). A completion ends the wait at once; the cost is at most
IDLE_WAIT_MAX_S for a new request that arrives while every request waits, so the wait grows only
with ``idle_backoff`` (on for CPU instances by default, config.py); otherwise it stays
IDLE_WAIT_S."""


class LayerKVWorker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: LayerKVConfig, is_producer: bool, is_consumer: bool) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._tp_rank, self._tp_size = tp_rank_and_size()
        self._compat = compat_info(vllm_config, kv_cache_config)
        self._stats = WorkerStats()
        # a kv_both instance traces to ".p": its prefill events are the ones worth reading
        self._tracer = Tracer(config.trace_path, "p" if is_producer else "d", self._tp_rank)
        self._transport: Transport | None = None  # made once the KV's device is known
        self._prefill: PrefillWorker | None = None
        self._decode: DecodeWorker | None = None
        self._sender: Sender | None = None
        self._meta: LayerKVMetadata | None = None
        self._early_release = False
        """Decode: report nearly done transfers early (``early_release_applies``)."""
        self._idle_wait = Backoff(IDLE_WAIT_S, IDLE_WAIT_MAX_S if config.backs_off_when_idle(
            device_type(vllm_config)) else IDLE_WAIT_S)
        """The wait grows only with idle_backoff on (CPU instances by default)."""
        previous = set_switch_interval(config.gil_switch_interval_ms)
        if previous is not None:
            logger.info("LayerKV: GIL switch interval %.3g ms in this worker process, was %.3g "
                        "ms (gil_switch_interval_ms)", config.gil_switch_interval_ms, previous)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = kv_groups(self._kv_cache_config)
        group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
        layout = KVLayout.from_kv_caches(kv_caches, self._kv_cache_config.num_blocks, group_of)
        if layout.block_bytes != self._compat.block_bytes:
            raise LayoutError(
                f"registered KV blocks are {layout.block_bytes} bytes per layer but the KV spec "
                f"says {self._compat.block_bytes}; unsupported KV cache layout"
            )
        if layout.num_layers != self._compat.num_layers:
            logger.info("LayerKV: %d distinct KV tensors for %d attention layers (KV sharing)",
                        layout.num_layers, self._compat.num_layers)
        blocks = block_io_for(layout, local_heads=max(1, self._compat.num_kv_heads))
        self._transport = create_transport(self._config.transport, blocks, self._config)
        if self._is_producer:
            hello = Hello(compat=self._compat, engine_id=self._engine_id,
                          tp_rank=self._tp_rank, tp_size=self._tp_size)
            parts = SenderParts(
                self._transport, blocks, hello, self._stats, self._tracer,
                layer_groups=layout.layer_groups,
                final_only_groups={i: g.kind for i, g in enumerate(groups)
                                   if g.kind in ("sliding", "mamba")})
            self._sender = Sender(parts, SenderTuning.from_config(self._config))
            self._prefill = PrefillWorker(self._config, layout, self._sender, self._tracer,
                                          self._stats)
        # the layout's device, not a value of kv_caches: vLLM 0.26 registers a Mamba layer as
        # a list of state tensors, and a hybrid model's first layer may be one
        self._early_release, why_not = early_release_applies(
            self._config.early_release, len(groups), self._tp_size, layout.device.type)
        if self._is_consumer and self._config.early_release and not self._early_release:
            logger.info("LayerKV: early_release does not apply here (%s)", why_not)
        if self._is_consumer:
            self._decode = DecodeWorker(self._config, blocks, self._transport, self._compat,
                                        self._tp_rank, self._tp_size, self._stats, self._tracer)
        logger.info(
            "LayerKV worker rank %d/%d ready: %d layers, %d blocks x %d B, transport %s, "
            "channels %s%s", self._tp_rank, self._tp_size, layout.num_layers,
            layout.num_blocks, layout.block_bytes, self._transport.name,
            "authenticated" if self._transport.authenticated else "unauthenticated",
            f", data endpoint {self._decode.endpoint}" if self._decode else "")

    def get_handshake_metadata(self) -> LayerKVHandshake:
        return LayerKVHandshake(data_endpoint=self._decode.endpoint if self._decode else "")

    # ------------------------------------------------------------------ per step
    def bind(self, meta: LayerKVMetadata) -> None:
        self._meta = meta
        if self._prefill is not None:
            self._prefill.bind(meta)
        if self._decode is not None:
            self._decode.bind(meta)
        if meta.first_steps and self._tracer.enabled:
            self._tracer.event("d_step_bound", req_ids=meta.first_steps)

    def on_layer_saved(self, layer_name: str) -> None:
        if self._prefill is not None:
            self._prefill.on_layer_saved(layer_name)

    def end_step(self) -> None:
        if self._prefill is not None:
            self._prefill.end_step()
        if self._meta is not None and self._meta.first_steps and self._tracer.enabled:
            # the forward is launched (on GPU it may still run; sampling follows)
            self._tracer.event("d_step_launched", req_ids=self._meta.first_steps)
        self._tracer.flush()

    def clear(self) -> None:
        self._meta = None

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        idle = self._meta is not None and self._meta.empty_step
        wait = self._idle_wait.current if idle else 0.0
        waited = event = False
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self._prefill is not None:
            if wait and self._prefill.has_pending() and self._sender is not None:
                waited = True
                event = self._sender.state.changed.wait(wait)
                self._sender.state.changed.clear()
            sending = self._prefill.finished_sending()
        if self._decode is not None:
            waited = waited or (wait > 0 and self._decode.pending())
            # early release only while nothing else runs here: the step that runs the
            # request waits for its last group before the forward, and would hold others up
            recving, failed = self._decode.results(wait, early=idle and self._early_release)
        if not waited or event or sending or recving or failed:
            self._idle_wait.reset()
        else:
            self._idle_wait.next()
        return sending, recving, failed

    def failed_blocks(self, request_failures: bool) -> set[int]:
        """D blocks with load errors since the last call (``get_block_ids_with_load_errors``):
        early-reported requests whose transfer failed, and with ``request_failures`` (vLLM
        0.26) every failed transfer."""
        if self._decode is None:
            return set()
        return self._decode.failed_blocks(request_failures)

    def stats(self) -> LayerKVStats | None:
        counts = self._stats.take()
        return LayerKVStats(data=counts.data) if counts is not None else None

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
        if self._transport is not None:
            self._transport.shutdown()

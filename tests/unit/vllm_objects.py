"""Real vLLM objects built offline, after vLLM's own tests/v1/kv_connector/unit/utils.py
(``create_vllm_config``, ``create_scheduler``, ``create_request``, ``assert_scheduler_empty``),
which is not installed with vLLM.

Plus ``Engine``: one P or D instance without a model. It owns a real
``vllm.v1.core.sched.scheduler.Scheduler`` (whose LayerKV scheduler connector vLLM builds
itself) and a real LayerKV *worker* connector over CPU KV tensors, and runs an engine step the
way vLLM 0.32's model runner does: bind metadata, "forward" (write each layer's KV rows for the
scheduled tokens, then fire ``save_kv_layer``), ``wait_for_save``, ``get_transfer_results``,
``update_from_output``. The KV a step "computes" for token t of layer L is a known function of
(t, L), so the bytes D ends up with can be checked against what P computed.
"""

from __future__ import annotations

import random

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_layerkv.connector import LayerKVConnector
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.testing.models import model_path

# tiny-llama geometry (vllm_layerkv.testing.models): 8 layers, 2 KV heads, head_dim 64
NUM_LAYERS, KV_HEADS, HEAD_SIZE = 8, 2, 64
BLOCK_SIZE = 16
EOS_TOKEN_ID = 1
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def create_vllm_config(kv_role: str, extra: dict[str, Any] | None = None, *,
                       max_num_batched_tokens: int = 64, block_size: int = BLOCK_SIZE,
                       kv_load_failure_policy: str = "fail", engine_id: str | None = None,
                       enable_prefix_caching: bool = True) -> VllmConfig:
    model_config = ModelConfig(model=str(model_path("tiny-llama")), dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    kv_transfer_config = KVTransferConfig(
        kv_connector="LayerKV", kv_connector_module_path="vllm_layerkv", kv_role=kv_role,
        kv_connector_extra_config=extra or {}, kv_load_failure_policy=kv_load_failure_policy,
        engine_id=engine_id)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, kv_transfer_config=kv_transfer_config,
                      device_config=DeviceConfig("cpu"))


SLIDING_WINDOW = 32
MAMBA_BLOCK_SIZE = BLOCK_SIZE
MAMBA_STATE_SHAPES = ((3, 8), (4, 16))
"""Conv and SSM state of one Mamba layer, per request (``create_kv_cache_config``)."""
"""A served model's Mamba group (no prefix caching) has max_model_len as block size, so one
state slot per request; here the scheduler's granularity forces the attention block size, so
a request holds several slots and its running state is in the last one (which is what vLLM's
``clip_ssm_state_blocks`` picks)."""


def create_kv_cache_config(num_blocks: int, dtype: torch.dtype = torch.float32,
                           block_size: int = BLOCK_SIZE, hybrid: str | None = None
                           ) -> KVCacheConfig:
    """All layers full attention; or ``hybrid`` = "mamba" / "sliding": the even layers form a
    Mamba (state page padded to the attention page, as vLLM pads it) / sliding-window group
    (window ``SLIDING_WINDOW``), the odd layers a full-attention group."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=dtype)
    if hybrid is None:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), full)])
    if hybrid == "mamba":
        other: Any = MambaSpec(block_size=MAMBA_BLOCK_SIZE, shapes=MAMBA_STATE_SHAPES,
                               dtypes=(dtype, dtype), page_size_padded=full.page_size_bytes)
    else:
        other = SlidingWindowSpec(block_size=block_size, num_kv_heads=KV_HEADS,
                                  head_size=HEAD_SIZE, dtype=dtype, sliding_window=SLIDING_WINDOW)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES[0::2], other), KVCacheGroupSpec(LAYER_NAMES[1::2], full)])


def create_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=vllm_config.cache_config.block_size, log_stats=True)


_none_hash_ready = False
_ids = count(1)


def create_request(num_tokens: int, kv_transfer_params: dict[str, Any] | None,
                   max_tokens: int = 1, request_id: str | None = None,
                   seed: int | None = None) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    n = next(_ids)
    sampling_params = SamplingParams(max_tokens=max_tokens)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    # Equal seeds give equal prompts (prefix-cache tests rely on it); anything else differs.
    # (Prompts once were 3 + (1000 * seed + i) % 4000: only four distinct ones, so an unrelated
    # earlier request could leave a prefix-cache hit on wiped blocks behind, depending on order.)
    rng = random.Random(f"seed-{seed}" if seed is not None else f"request-{n}")
    req = Request(request_id=request_id or f"req-{n}",
                  prompt_token_ids=[rng.randrange(3, 4003) for _ in range(num_tokens)],
                  sampling_params=sampling_params, pooling_params=None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = kv_transfer_params
    return req


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No leaked requests or blocks (vLLM's helper of the same name)."""
    assert len(scheduler.requests) == 0, list(scheduler.requests)
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_recving_kv_req_ids) == 0
    assert len(scheduler.failed_recving_kv_req_ids) == 0
    assert len(scheduler._inflight_prefills) == 0
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert len(manager.req_to_blocks) == 0
    assert len(manager.num_cached_block) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    # (vLLM decrements the null block's count whenever it frees a table that holds it: freed
    # sliding-window and Mamba slots; it is never handed out, so its count means nothing)
    leaked = [(b.block_id, b.ref_cnt) for b in pool.blocks if b.ref_cnt and not b.is_null]
    assert not leaked, leaked


def salt(req: Request) -> int:
    """Distinguishes the KV of different prompts (same prompt, same KV, like a real model)."""
    return req.prompt_token_ids[0] % 199 + 1


def kv_value(token: int, layer: int, salt: int) -> float:
    """What the fake forward writes for (token position, layer) of a prompt: an integer below
    2**24, so exact in float32 (and in float16 it is never compared)."""
    return float(salt * 65536 + layer * 4096 + token + 1)


def mamba_state_views_of(pages: torch.Tensor) -> list[torch.Tensor]:
    """vLLM 0.26's registration of a Mamba layer: its conv and SSM state
    (``MAMBA_STATE_SHAPES``) as strided views into the layer's padded pages, one after the
    other in each page, conv state first."""
    page, offset = pages[0].numel(), 0
    views: list[torch.Tensor] = []
    for rows, cols in MAMBA_STATE_SHAPES:
        views.append(torch.as_strided(pages.view(-1)[offset:], (pages.shape[0], rows, cols),
                                      (page, cols, 1)))
        offset += rows * cols
    return views


@dataclass
class StepRecord:
    meta: LayerKVMetadata
    num_scheduled: dict[str, int]
    kv_output: KVConnectorOutput
    outputs: list[EngineCoreOutput]
    kv_connector_stats: list[dict[str, Any]] = field(default_factory=list)
    """What vLLM's scheduler reported of the connector's stats this step (workers' and its
    own, summed)."""


@dataclass
class Engine:
    """One LayerKV instance: real scheduler + real worker connector on CPU KV tensors."""

    role: str
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Scheduler
    worker: LayerKVConnector
    kv: dict[str, torch.Tensor]
    history: list[StepRecord] = field(default_factory=list)
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)
    sampled_token: int = 7
    layer_hooks: bool = True
    """False: the forward writes KV without calling the per-layer hook, as a FULL CUDA-graph
    replay does on GPU (only ``wait_for_save`` runs)."""

    @classmethod
    def create(cls, role: str, extra: dict[str, Any] | None = None, *, num_blocks: int = 64,
               dtype: torch.dtype = torch.float32, fill: float = -1.0,
               hybrid: str | None = None, mamba_state_views: bool = False,
               **config_kw: Any) -> Engine:
        """``mamba_state_views``: register each Mamba layer as vLLM 0.26 does, as
        ``[conv_state, ssm_state]`` views into its pages (0.32+: one tensor per layer)."""
        vllm_config = create_vllm_config(role, extra, **config_kw)
        kv_cache_config = create_kv_cache_config(num_blocks, dtype, hybrid=hybrid)
        scheduler = create_scheduler(vllm_config, kv_cache_config)
        assert isinstance(scheduler.connector, LayerKVConnector)
        worker = LayerKVConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        kv = {name: torch.full((num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), fill,
                               dtype=dtype) for name in LAYER_NAMES}
        registered: dict[str, Any] = dict(kv)
        if mamba_state_views:
            assert hybrid == "mamba"
            for name in LAYER_NAMES[0::2]:
                registered[name] = mamba_state_views_of(kv[name])
        worker.register_kv_caches(registered)
        # vLLM's handshake: each worker's metadata reaches its own scheduler connector
        scheduler.connector.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        return cls(role, vllm_config, kv_cache_config, scheduler, worker, kv)

    # ------------------------------------------------------------------ helpers
    @property
    def connector(self) -> LayerKVConnector:
        return self.scheduler.connector  # type: ignore[return-value]

    @property
    def endpoint(self) -> str:
        """P's registration endpoint, found the way the proxy finds it (discovery request)."""
        req = create_request(4, {"layerkv_discover": True}, max_tokens=1)
        self.scheduler.add_request(req)
        self.run_until(lambda: req.request_id in self.finished, timeout=10)
        params = self.finished[req.request_id].kv_transfer_params
        assert params is not None and params["role"] == self.role
        return params["layerkv_endpoint"]

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def group_of(self, layer: int) -> tuple[int, str]:
        """(KV cache group index, spec class name) of a layer."""
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            if LAYER_NAMES[layer] in g.layer_names:
                return i, type(g.kv_cache_spec).__name__
        raise KeyError(layer)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def token_rows(self, layer: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens, KV_HEADS, 2*HEAD_SIZE]: layer's KV rows of tokens 0..num_tokens-1."""
        t = self.kv[LAYER_NAMES[layer]]
        rows = [t[block_ids[i // BLOCK_SIZE], :, i % BLOCK_SIZE, :] for i in range(num_tokens)]
        return torch.stack(rows)

    # ------------------------------------------------------------------ one engine step
    def step(self) -> StepRecord:
        return self.execute(self.scheduler.schedule())

    def execute(self, so: SchedulerOutput) -> StepRecord:
        """The model-runner half of a step (after ``scheduler.schedule()``)."""
        meta = so.kv_connector_metadata
        assert isinstance(meta, LayerKVMetadata)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        if so.total_num_scheduled_tokens:
            self._forward(so)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(so.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors())
        self.worker.clear_connector_metadata()

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            # a partial prefill samples nothing
            sampled.append([self.sampled_token] if req.num_computed_tokens >= req.num_tokens
                           else [])
        mro = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv_output)
        engine_outputs = self.scheduler.update_from_output(so, mro)
        outs = [o for eco in engine_outputs.values() for o in eco.outputs]
        for o in outs:
            if o.finish_reason is not None:
                self.finished[o.request_id] = o
        stats = [eco.scheduler_stats.kv_connector_stats for eco in engine_outputs.values()
                 if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats]
        record = StepRecord(meta, dict(so.num_scheduled_tokens), kv_output, outs, stats)
        self.history.append(record)
        return record

    def _forward(self, so: SchedulerOutput) -> None:
        """Write every scheduled token's KV layer by layer, firing the per-layer hook after
        each layer like vLLM's attention layers do."""
        spans = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            spans.append((req_id, start, start + n, salt(req)))
        for layer, name in enumerate(LAYER_NAMES):
            t = self.kv[name]
            group, kind = self.group_of(layer)
            for req_id, start, end, s in spans:
                blocks = self.block_ids(req_id, group)
                if kind == "MambaSpec":  # a running state, overwritten in place: "h(end)"
                    t[blocks[-1]] = kv_value(end - 1, layer, s)
                    continue
                for tok in range(start, end):
                    t[blocks[tok // BLOCK_SIZE], :, tok % BLOCK_SIZE, :] = kv_value(tok, layer, s)
            if self.layer_hooks:
                self.worker.save_kv_layer(name, t, None)

    def run_until(self, cond: Callable[[], bool], timeout: float = 10.0,
                  others: tuple[Engine, ...] = ()) -> None:
        """Step this engine (and ``others``) until ``cond()`` holds."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role}: condition not reached in {timeout} s")
            self.step()
            for other in others:
                other.step()
            time.sleep(0.001)

    def idle(self) -> bool:
        return not self.scheduler.requests

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def assert_connector_empty(engine: Engine) -> None:
    """LayerKV's own bookkeeping holds nothing for finished requests (scheduler and worker
    halves). Reads private state on purpose: a leak there grows without bound in a server."""
    sched = engine.connector._scheduler
    assert sched is not None
    assert not sched._parsed and not sched._errors, (sched._parsed, sched._errors)
    if sched._prefill is not None:
        pre = sched._prefill
        assert not pre._by_req and not pre._by_tid, list(pre._by_req)
        assert not pre._first_seen and not pre._early_regs, (pre._first_seen, pre._early_regs)
    if sched._decode is not None:
        dec = sched._decode
        assert not dec._waiting and not dec._by_tid, list(dec._waiting)
        assert not dec._local_hits and not dec._admitted, (dec._local_hits, dec._admitted)
    worker = engine.worker._worker
    assert worker is not None
    if worker._prefill is not None:
        assert not worker._prefill._releases, worker._prefill._releases
        assert worker._sender is not None and not worker._sender.state.transfers
    if worker._decode is not None:
        assert worker._decode._table.pending() == 0

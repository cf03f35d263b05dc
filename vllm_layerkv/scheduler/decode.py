"""Decode-side scheduler half: parks a request, registers its blocks with the prefill instance,
and fails it cleanly when the KV cannot come (refused, unreachable, timed out).

Flow per request (decode registers first, DESIGN.md):

1. ``get_num_new_matched_tokens``: all prompt tokens not in D's own prefix cache will arrive
   asynchronously -> vLLM allocates blocks and parks the request in WAITING_FOR_REMOTE_KVS.
2. ``update_state_after_alloc``: send ``Register`` (block ids, data endpoints) to P from a
   background thread, and tell the workers to expect the transfer (next step's metadata).
3. Workers report the request finished receiving; vLLM recomputes the last prompt token and
   decodes. On refusal or timeout, workers report it failed (vLLM's kv_load_failure_policy
   then fails or recomputes it), and P is told to stop.

With ``first_token_from_prefill`` (the proxy has sent the client the token P sampled after
the prompt), D continues from P's token instead of sampling its own: the registration asks P
for it, P sends it when its request finishes (``FirstToken``), the workers report the request
only once the token is here too, and it is appended to the prompt before vLLM schedules the
request (``compat.append_prompt_token``). D then computes that one token, as it would have
recomputed the last prompt token.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.compat import append_prompt_token, intake_marks, scheduled_req_ids
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv.groups import NULL_BLOCK
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.scheduler.registrar import RegistrationClient
from vllm_layerkv.scheduler.request_params import DecodeParams, PrefillAddress
from vllm_layerkv.tasks import RecvClose, RecvTask
from vllm_layerkv.wire.auth import ChannelAuth
from vllm_layerkv.wire.protocol import Cancel, CompatInfo, FirstToken, Refused, Register

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Waiting:
    req_id: str
    transfer_id: str
    endpoint: PrefillAddress
    deadline: float
    closed: bool = False
    request: Request | None = None
    """vLLM's Request, kept when it is to continue from P's first token."""
    first_token: int | None = None


class DecodeScheduler:
    def __init__(self, config: LayerKVConfig, compat: CompatInfo, tp_size: int, engine_id: str,
                 backoff: int = 0) -> None:
        self._config = config
        self._backoff = backoff
        """Trailing prompt tokens D computes itself (Mamba state: P sends h(N-1))."""
        self._compat = compat
        self._tp_size = tp_size
        self._engine_id = engine_id
        self._data_endpoints: list[str] = []
        self._client = RegistrationClient(config.connect_timeout_s, config.io_timeout_s,
                                          ChannelAuth.from_config(config))
        self._waiting: dict[str, _Waiting] = {}
        self._by_tid: dict[str, _Waiting] = {}
        self._local_hits: dict[str, int] = {}
        self._admitted: set[str] = set()
        """Requests already registered (vLLM calls update_state_after_alloc again, with 0
        external tokens, when a request is re-admitted after its KV arrived)."""
        self._pending = LayerKVMetadata()
        self._tracer = Tracer(config.trace_path, "dsched", 0)
        self._received: set[str] = set()
        """Received requests not yet scheduled for their first token (``first_steps``)."""

    def set_data_endpoints(self, endpoints: list[str]) -> None:
        if any(not e for e in endpoints):
            raise RuntimeError("a LayerKV decode worker published no data endpoint")
        self._data_endpoints = endpoints
        logger.info("LayerKV decode data endpoints: %s", endpoints)

    def num_matched_tokens(self, request: Request, num_computed_tokens: int,
                           transfer_id: str | None = None) -> tuple[int, bool]:
        """``transfer_id`` names the request in the trace (``d_seen``, with when it entered
        vLLM)."""
        if request.request_id in self._admitted:
            # Asked again: D preempted the request after its KV arrived and freed the blocks.
            # P has long released the prompt's KV, so D recomputes it (prefix cache permitting).
            return 0, False
        if self._tracer.enabled and request.request_id not in self._local_hits:
            self._tracer.event("d_seen", transfer_id=transfer_id, **intake_marks(request))
        self._local_hits[request.request_id] = num_computed_tokens
        n = request.num_prompt_tokens - self._backoff - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
                    params: DecodeParams) -> None:
        req_id = request.request_id
        local = self._local_hits.pop(req_id, 0)
        if req_id in self._admitted:
            return
        self._admitted.add(req_id)
        if num_external_tokens == 0:
            # everything was in D's own prefix cache: P need not wait for us
            self._client.send(params.remote, Cancel(
                transfer_id=params.transfer_id, reason="decode had the whole prompt cached"))
            return
        if not self._data_endpoints:
            raise RuntimeError("LayerKV decode workers have not published data endpoints")
        block_ids = [list(g) for g in blocks.get_block_ids()]
        first = params.first_token_from_prefill
        reg = Register(
            transfer_id=params.transfer_id, engine_id=self._engine_id, compat=self._compat,
            tp_size=self._tp_size, data_endpoints=self._data_endpoints, block_ids=block_ids,
            start_token=local, num_tokens=local + num_external_tokens,
            wants_first_token=first)
        w = _Waiting(req_id, params.transfer_id, params.remote,
                     deadline=time.monotonic() + self._config.kv_wait_timeout_s,
                     request=request if first else None)
        self._waiting[req_id] = w
        self._by_tid[params.transfer_id] = w
        writable = sorted({b for g in block_ids for b in g if b != NULL_BLOCK})
        self._pending.recvs.append(RecvTask(req_id, params.transfer_id, writable, first))
        if first and self._backoff:
            # P's prompt is cut short by the backoff: the token it samples is not the first
            self._fail(w, "first_token_from_prefill does not work with models that keep "
                          "Mamba/SSM state (the prefill instance computes the prompt minus "
                          f"its last {self._backoff} token(s)); send this request without it "
                          "(the proxy's --first-token-from-prefill off)", notify_prefill=True)
            return
        if self._tracer.enabled:
            self._tracer.event("d_registering", transfer_id=params.transfer_id)
        self._client.send(params.remote, reg)

    def fail_at_once(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
                     reason: str) -> None:
        """A request that asked for a remote prefill D cannot serve: it fails through vLLM's
        KV-load-failure path, as one whose registration P refused does."""
        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        if req_id in self._admitted or num_external_tokens == 0:
            return
        self._admitted.add(req_id)
        transfer_id = f"unserved-{req_id}"
        w = _Waiting(req_id, transfer_id, "", deadline=time.monotonic())
        self._waiting[req_id] = w
        self._by_tid[transfer_id] = w
        writable = sorted({b for g in blocks.get_block_ids() for b in g if b != NULL_BLOCK})
        self._pending.recvs.append(RecvTask(req_id, transfer_id, writable))
        self._fail(w, reason, notify_prefill=False)

    def build_meta(self, meta: LayerKVMetadata,
                   scheduler_output: SchedulerOutput | None = None) -> None:
        self._drain_replies()
        if self._received and scheduler_output is not None:
            self._mark_first_steps(meta, scheduler_output)
        now = time.monotonic()
        for w in list(self._waiting.values()):
            if not w.closed and now > w.deadline:
                self._fail(w, f"no KV from prefill {w.endpoint} within "
                              f"kv_wait_timeout_s={self._config.kv_wait_timeout_s:.0f} s",
                           notify_prefill=True)
        pending, self._pending = self._pending, LayerKVMetadata()
        meta.recvs += pending.recvs
        meta.recv_closes += pending.recv_closes
        meta.first_tokens += pending.first_tokens

    def request_finished(self, req_id: str) -> None:
        """The request ended; if it still waits for KV (aborted), stop the transfer."""
        self._local_hits.pop(req_id, None)
        self._admitted.discard(req_id)
        self._received.discard(req_id)  # received, then aborted before it ran
        w = self._waiting.get(req_id)
        if w is not None and not w.closed:
            w.closed = True
            self._pending.recv_closes.append(
                RecvClose(req_id, w.transfer_id, failed=False, reason="aborted"))
            self._client.send(w.endpoint, Cancel(transfer_id=w.transfer_id,
                                                 reason="decode request aborted"))

    def finished_recving(self, req_ids: set[str]) -> None:
        """vLLM has the workers' report (it readies these requests right after this call)."""
        self._received |= req_ids
        if self._tracer.enabled:
            # vLLM has the worker's report now (with async scheduling, one step after it)
            self._tracer.event("recv_seen", req_ids=sorted(req_ids))
            self._tracer.flush()
        for req_id in req_ids:
            w = self._waiting.pop(req_id, None)
            if w is None:
                continue
            self._by_tid.pop(w.transfer_id, None)
            # the workers report such a request only with its token (or failed: then vLLM
            # fails it, or recomputes it, which with the token appended is right too)
            if w.request is not None and w.first_token is not None:
                if not append_prompt_token(w.request, w.first_token):
                    logger.error("request %s: cannot append the first token from prefill to "
                                 "a prompt that is not token ids", req_id)

    def shutdown(self) -> None:
        self._client.close()

    def _mark_first_steps(self, meta: LayerKVMetadata, scheduler_output: SchedulerOutput
                          ) -> None:
        """The step that computes a received request's first token: the worker waits there for
        KV of a request it reported early, and the profile splits D's part of TTFT at it
        (scheduled here, bound and launched on the worker)."""
        scheduled = scheduled_req_ids(scheduler_output)
        first = sorted(self._received & scheduled)
        if first:
            self._received -= set(first)
            meta.first_steps += first
            if self._tracer.enabled:
                self._tracer.event("d_scheduled", req_ids=first)
                self._tracer.flush()

    def _drain_replies(self) -> None:
        while True:
            try:
                reply = self._client.replies.get_nowait()
            except queue.Empty:
                return
            if isinstance(reply, Refused):
                w = self._by_tid.get(reply.transfer_id)
                if w is not None and not w.closed:
                    self._fail(w, reply.reason, notify_prefill=False)
            elif isinstance(reply, FirstToken):
                w = self._by_tid.get(reply.transfer_id)
                if w is not None and w.request is not None and w.first_token is None:
                    w.first_token = reply.token_id
                    self._pending.first_tokens.append(reply.transfer_id)

    def _fail(self, w: _Waiting, reason: str, notify_prefill: bool) -> None:
        logger.error("LayerKV: request %s (transfer %s) cannot get its KV: %s", w.req_id,
                     w.transfer_id, reason)
        w.closed = True
        self._pending.recv_closes.append(RecvClose(w.req_id, w.transfer_id, True, reason))
        if notify_prefill:
            self._client.send(w.endpoint, Cancel(transfer_id=w.transfer_id, reason=reason))

"""Prefill-side scheduler half: matches decode registrations to prefill requests and, every engine
step, tells the workers which blocks to push where.

Bookkeeping per request is a *send watermark*: D holds KV for tokens ``[0, sent_tokens)``. Each
step that computes tokens up to ``end`` sends the blocks covering ``[sent_tokens, end)``. The
block that holds ``sent_tokens`` may be partly filled and is sent again next time; one ordered
connection per rank pair makes the later copy win. The same rule covers every late case:

* registration arrives after some chunks ran: the next step's send starts at the watermark, so
  the chunks already computed go out with it (catch-up from P's still-allocated blocks);
* P hit its own prefix cache: those tokens are below ``end`` and go out the same way;
* registration arrives after P finished: the blocks are held (``request_finished`` returns True)
  and flushed at once;
* the request was preempted on P (its blocks freed and maybe reused while queued sends read
  them): the watermark drops back to D's start, so everything is sent again after it resumes.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_layerkv.common.backoff import Backoff
from vllm_layerkv.common.log import RateLimitedWarning, init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.compat import scheduled_requests
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv import tp
from vllm_layerkv.kv.groups import (
    ATTENTION_KINDS,
    BlockTableError,
    KVGroupInfo,
    select_blocks,
)
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.scheduler.bootstrap import BootstrapError, BootstrapServer, register_with
from vllm_layerkv.scheduler.registrar import RegistrationServer
from vllm_layerkv.scheduler.request_params import PrefillParams
from vllm_layerkv.tasks import Peer, SendTask
from vllm_layerkv.wire.admission import ListenerLimits
from vllm_layerkv.wire.auth import ChannelAuth
from vllm_layerkv.wire.protocol import (
    Cancel,
    CompatInfo,
    FirstToken,
    Refused,
    Register,
    RegisterAck,
)
from vllm_layerkv.wire.refusals import mismatch_refusal

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)
IDLE_WAIT_MIN_S = 0.01
IDLE_WAIT_MAX_S = 1.25
"""While P only waits for decode registrations (prefills deferred for one, finished prefills
holding their blocks for one) and vLLM steps the engine with nothing to schedule, the scheduler
waits for a registration or cancel before each such step (it returns as soon as one arrives):
first IDLE_WAIT_MIN_S, doubling on every further idle step up to IDLE_WAIT_MAX_S, and never past
the next deadline (end of a deferral, expiry of a hold). vLLM keeps stepping for as long as P
holds blocks, and unthrottled every empty step is a full round trip through the executor:
~700 steps/s with TP=2 on CPU, which starved every other process of a 2-core host, and vLLM's
workers busy-poll their message queue for 1 s after each step, which starved a decode worker
pinned to the same core (measured: D's first registration then only arrived after
registration_timeout_s, and D requests stalled for the whole hold). The ceiling is above that
1 s, so a long hold leaves P's workers idle. The cost: a new request that reaches P during such
a wait is scheduled up to that long later, which is why only ``idle_backoff`` (on for CPU
instances by default, config.py) turns this on."""
DEFERRAL_WAIT_S = 0.0005
"""Without ``idle_backoff`` (GPUs), an empty step while P only waits for registrations still
waits this long for one, ended the moment it arrives. The wait is there to release the GIL:
vLLM's engine loop runs empty steps back to back in Python, and CPython gives the GIL to another
thread only after ``sys.getswitchinterval()`` (5 ms) of that, so the thread that had D's
registration on its socket waited for it (measured on an H200 host: P held 4K prefills
0.4-7 ms, median 2 ms, for registrations D had sent). A request that reaches P during the wait
is scheduled at most this much later."""
ADMISSION_WAIT_S = 0.003
"""While P is idle (every request of its last step has finished, and it admitted nothing yet in
this scheduling pass), the pass that finds a prefill still without its registration waits up to
this long for it, and admits the request in that same pass when it comes. Otherwise the
request waits out the empty step that pass becomes (a round trip through vLLM's executor) and
the next pass: on H200 hosts P admitted prefills 0.5-1.5 ms after their registration had
arrived. P has nothing else to run in such a pass; a request that reaches the engine during
the wait is scheduled at most this much later. One budget per pass, shared by the deferred
prefills it finds."""
LATE_REGISTRATION_STREAK = 3
"""After this many registrations in a row that arrived only once their prefill had finished, P
stops holding new prefills back for registrations: the router in front sends the decode request
after the prefill's answer (vllm-router does, in its mooncake mode too), so the wait only adds
``registration_wait_s`` to every request. One registration that arrives while its prefill runs
turns the wait back on."""


@dataclass
class _Prefill:
    req_id: str
    transfer_id: str
    num_prompt_tokens: int
    block_ids: list[list[int]]
    """P's block ids per KV cache group, in token order."""
    reg: Register | None = None
    peer: Peer | None = None
    sent_tokens: int = 0
    computed_tokens: int = 0
    final_sent: bool = False
    finished: bool = False
    released: bool = False
    hold_deadline: float = 0.0
    first_token: int | None = None
    """The token the request sampled after its prompt (known once it finished)."""
    sequential: bool = False
    """P minted the transfer id: D learns it from P's answer and registers only then."""


class PrefillScheduler:
    def __init__(self, config: LayerKVConfig, compat: CompatInfo, tp_size: int,
                 groups: list[KVGroupInfo], engine_id: str, idle_backoff: bool = False,
                 dp_rank: int = 0) -> None:
        """``idle_backoff``: throttle empty engine steps while P only waits for registrations
        (``LayerKVConfig.idle_backoff`` resolved for this instance's device)."""
        self._config = config
        self._idle_backoff = idle_backoff
        self._compat = compat
        self._tp_size = tp_size
        self._groups = groups
        # The watermark moves in whole attention blocks (all attention groups of a hybrid share
        # one block size; a model without attention only sends at the end).
        self._block_size = next((g.block_size for g in groups if g.kind in ATTENTION_KINDS),
                                groups[0].block_size)
        self._engine_id = engine_id
        self._incoming: queue.SimpleQueue[Register | Cancel] = queue.SimpleQueue()
        self._by_req: dict[str, _Prefill] = {}
        self._by_tid: dict[str, _Prefill] = {}
        self._early_regs: dict[str, tuple[Register, float]] = {}
        """Registrations that arrived before P saw the request (D is often faster), oldest
        first. Kept until the request comes, D cancels (on its timeout or abort), or
        ``early_registration_ttl_s`` passes."""
        self._early_ttl_s = config.early_registration_ttl_s
        self._unmatched = 0
        """Registrations accepted and not yet attached to a request: queued for the scheduler
        thread or held in ``_early_regs``; at most ``max_early_registrations``."""
        self._unmatched_lock = threading.Lock()
        self._cap_warning = RateLimitedWarning(logger)
        self._gone: dict[str, float] = {}
        """transfer_id -> when P stopped serving it (aborted, gave up): late registrations are
        refused instead of waiting forever (for ``early_registration_ttl_s``)."""
        self._pending = LayerKVMetadata()
        self._first_seen: dict[str, float] = {}
        self._arrived = threading.Event()
        """Set by the registration threads when a Register or Cancel is queued."""
        self._idle_wait = Backoff(IDLE_WAIT_MIN_S, IDLE_WAIT_MAX_S)
        self._under_way: set[str] = set()
        """The requests the last step scheduled that have not finished since (any request of
        this instance, LayerKV's or not): P is idle once there are none."""
        self._admitted_in_pass = False
        self._pass_wait_left = ADMISSION_WAIT_S
        self._tracer = Tracer(config.trace_path, "psched", 0)
        self._auth = ChannelAuth.from_config(config)
        self._limits = ListenerLimits.from_config(config)
        self._server = RegistrationServer(config.host, config.registration_port,
                                          self._on_register, self._on_cancel, self._auth,
                                          self._limits)
        self.endpoint = self._server.endpoint
        self._bootstrap = self._serve_bootstrap(dp_rank) if config.bootstrap_port else None
        self._late_registrations = 0
        """Registrations in a row that arrived after their prefill finished."""
        self._said_sequential = False
        logger.info("LayerKV prefill registration endpoint %s (engine %s, TP %d)", self.endpoint,
                    engine_id, tp_size)

    # ------------------------------------------------------------ registration server threads
    def _on_register(self, reg: Register) -> RegisterAck | Refused:
        mismatch = tp.peer_error(self._compat, self._tp_size, reg.compat, reg.tp_size,
                                 f"decode {reg.engine_id}")
        if mismatch is not None:  # the values stay in this log; D learns the field names
            logger.error("refusing registration of transfer %s: %s", reg.transfer_id, mismatch)
            return Refused(transfer_id=reg.transfer_id, reason=mismatch_refusal(
                self._compat, self._tp_size, reg.compat, reg.tp_size, "prefill"))
        err = None
        if reg.transfer_id in self._gone:
            err = "the prefill request for this transfer_id was aborted or gave up waiting"
        elif len(reg.data_endpoints) != reg.tp_size:
            err = f"registration lists {len(reg.data_endpoints)} endpoints for TP {reg.tp_size}"
        elif not self._hold_registration(tracked=reg.transfer_id in self._by_tid):
            err = (f"the prefill instance holds max_early_registrations="
                   f"{self._config.max_early_registrations} registrations for requests it has "
                   "not received yet; raise max_early_registrations on it, or check that the "
                   "router sends it the prefill requests")
            self._cap_warning.warning("refusing registration of transfer %s: %s",
                                      reg.transfer_id, err)
            return Refused(transfer_id=reg.transfer_id, reason=err)
        if err is not None:
            logger.error("refusing registration of transfer %s: %s", reg.transfer_id, err)
            return Refused(transfer_id=reg.transfer_id, reason=err)
        self._incoming.put(reg)
        self._arrived.set()
        if self._tracer.enabled:
            self._tracer.event("reg_arrived", transfer_id=reg.transfer_id)
            self._tracer.flush()
        return RegisterAck(transfer_id=reg.transfer_id, tp_size=self._tp_size)

    def _on_cancel(self, msg: Cancel) -> None:
        self._incoming.put(msg)
        self._arrived.set()

    def _hold_registration(self, tracked: bool) -> bool:
        """Count one more unmatched registration, unless the cap is reached. One for a request
        P already serves (``tracked``) is counted past the cap: it is matched at the next
        step, and refusing it would fail an honest request because of others."""
        with self._unmatched_lock:
            if not tracked and self._unmatched >= self._config.max_early_registrations:
                return False
            self._unmatched += 1
            return True

    def _matched(self) -> None:
        """An unmatched registration was attached, dropped or refused after all."""
        with self._unmatched_lock:
            self._unmatched -= 1

    def _mark_gone(self, transfer_id: str) -> None:
        """Refuse registrations for ``transfer_id`` from now on (``_gone`` stays oldest
        first)."""
        self._gone.pop(transfer_id, None)
        self._gone[transfer_id] = time.monotonic()

    def _take_early(self, transfer_id: str) -> Register | None:
        early = self._early_regs.pop(transfer_id, None)
        if early is None:
            return None
        self._matched()
        return early[0]

    # ------------------------------------------------------------ scheduler thread
    def should_defer(self, req_id: str, params: PrefillParams,
                     intake: dict[str, float] | None = None) -> bool:
        """Hold a new prefill back until D's registration is here (at most
        ``registration_wait_s``): only a registered request can stream its first chunk while it
        is computed. D receives the request concurrently, so the wait is normally a few ms.
        ``intake``: when the request entered vLLM (``compat.intake_marks``), traced with it."""
        wait = self._config.registration_wait_s
        if self._tracer.enabled and req_id not in self._by_req and req_id not in self._first_seen:
            self._tracer.event("p_seen", transfer_id=params.transfer_id, **(intake or {}))
        if wait <= 0 or req_id in self._by_req:  # re-admitted after preemption: go on
            return False
        if params.sequential or self._late_registrations >= LATE_REGISTRATION_STREAK:
            return False  # D registers only after this prefill's answer
        self._drain_incoming()
        first = self._first_seen.setdefault(req_id, time.monotonic())
        if self._registered(params.transfer_id, until=first + wait):
            self._first_seen.pop(req_id, None)
            return False
        if time.monotonic() - first < wait:
            return True
        self._first_seen.pop(req_id, None)
        logger.info("transfer %s: no decode registration after registration_wait_s=%.2f s; "
                    "prefilling anyway (KV goes out once it registers)", params.transfer_id, wait)
        return False

    def _registered(self, transfer_id: str, until: float) -> bool:
        """Whether D's registration for ``transfer_id`` is here; while P is idle, waits for it
        within the pass's ADMISSION_WAIT_S (and never past ``until``, the deferral's end)."""
        if transfer_id in self._early_regs:
            return True
        if not self._idle():
            return False
        start = time.monotonic()
        end = min(start + self._pass_wait_left, until)
        try:
            while (left := end - time.monotonic()) > 0:
                if self._arrived.wait(left):
                    self._arrived.clear()  # what arrived is drained now
                    self._drain_incoming()
                    if transfer_id in self._early_regs:
                        return True
            return False
        finally:
            self._pass_wait_left = max(0.0, self._pass_wait_left - (time.monotonic() - start))

    def _idle(self) -> bool:
        """Nothing for P to run in this pass but what waits for a registration: no request of
        the last step is still under way, and this pass admitted none."""
        return not self._admitted_in_pass and not self._under_way

    def request_ended(self, req_id: str) -> None:
        """Any request of this instance finished (LayerKV's or not)."""
        self._under_way.discard(req_id)

    def track(self, req_id: str, params: PrefillParams, num_prompt_tokens: int) -> str | None:
        """Start serving a prefill request; returns an error message if it cannot be."""
        self._admitted_in_pass = True  # this pass runs work: later ones in it must not wait
        if req_id in self._by_req:  # re-admitted after preemption: already tracked
            return None
        self._first_seen.pop(req_id, None)
        if params.transfer_id in self._by_tid:
            return (f"transfer_id {params.transfer_id!r} is already in use by another request; "
                    "mint a fresh transfer_id per request")
        p = _Prefill(req_id, params.transfer_id, num_prompt_tokens,
                     block_ids=[[] for _ in self._groups], sequential=params.sequential)
        if params.sequential:
            self._say_sequential("a prefill request without a transfer_id (a router that sends "
                                 "the decode request after the prefill's answer)")
        if self._tracer.enabled:
            self._tracer.event("p_admitted", transfer_id=params.transfer_id)
            self._tracer.flush()
        self._by_req[req_id] = p
        self._by_tid[params.transfer_id] = p
        early = self._take_early(params.transfer_id)
        if early is not None:
            self._attach(p, early)
        return None

    def build_meta(self, meta: LayerKVMetadata, scheduler_output: SchedulerOutput) -> None:
        # the end of a scheduling pass: what the next one may wait for depends on this step
        self._under_way = set(scheduler_output.num_scheduled_tokens)
        self._admitted_in_pass = False
        self._pass_wait_left = ADMISSION_WAIT_S
        self._wait_for_decode(scheduler_output)
        self._drain_incoming()
        self._expire()
        pending, self._pending = self._pending, LayerKVMetadata()
        meta.flushes += pending.flushes
        meta.releases += pending.releases
        meta.aborts += pending.aborts
        if not self._by_req:
            return
        scheduled = scheduled_requests(scheduler_output)
        for req_id, computed, new_blocks, resumed, is_new in scheduled:
            p = self._by_req.get(req_id)
            if p is None or p.finished:
                continue
            if is_new and any(p.block_ids):
                resumed = True  # Model Runner V2 lists resumed requests as new ones
            if resumed:  # preempted and back: blocks were freed, possibly mid-send
                p.block_ids = [[] for _ in self._groups]
                if p.reg is not None:
                    p.sent_tokens = p.reg.start_token
                    p.final_sent = False
            if new_blocks is not None:
                for table, new in zip(p.block_ids, new_blocks):
                    table.extend(new)
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            p.computed_tokens = min(computed + n, p.num_prompt_tokens)
            if p.reg is not None and not p.final_sent and n > 0:
                task = self._task(p, p.computed_tokens)
                if task is not None:
                    meta.sends.append(task)

    def request_finished(self, req_id: str, transfer_id: str, block_ids: list[list[int]],
                         complete: bool, first_token: int | None = None
                         ) -> tuple[bool, dict[str, object] | None]:
        """``first_token``: what the request sampled after its prompt; sent to a D that asked
        for it (``Register.wants_first_token``)."""
        self._first_seen.pop(req_id, None)
        p = self._by_req.get(req_id)
        if p is None:  # ended before it was scheduled (aborted while deferred, or refused)
            self._drain_incoming()
            self._mark_gone(transfer_id)  # a later registration is refused
            self._server.forget(transfer_id)
            reg = self._take_early(transfer_id)
            if reg is not None:  # D registered already: tell it through its data endpoint
                self._pending.aborts.append((transfer_id, "prefill request aborted",
                                             Peer(reg.engine_id, reg.tp_size,
                                                  list(reg.data_endpoints))))
            return False, None
        p.finished = True
        if self._tracer.enabled:  # vLLM has P's token: its answer leaves now
            self._tracer.event("p_finished", transfer_id=transfer_id)
            self._tracer.flush()
        params = self._answer(p)
        self._drain_incoming()
        if not complete:
            reason = "prefill request ended before its prompt was computed (aborted)"
            if p.reg is None:
                self._forget(p)
                return False, params
            self._pending.aborts.append((p.transfer_id, reason, p.peer))
            self._release(p)
            return True, params
        p.block_ids = [list(b) for b in block_ids]
        p.computed_tokens = p.num_prompt_tokens
        p.first_token = first_token
        self._push_first_token(p)
        if p.reg is None:
            p.hold_deadline = time.monotonic() + self._config.registration_timeout_s
        elif not p.final_sent:
            self._flush(p)
        else:
            self._release(p)
        return True, params

    def finished_sending(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            p = self._by_req.get(req_id)
            if p is not None:
                self._forget(p)

    def _wait_for_decode(self, scheduler_output: SchedulerOutput) -> None:
        """On empty engine steps while P only waits for registrations, wait for one: with
        ``idle_backoff`` a growing wait that throttles the steps (IDLE_WAIT_MAX_S), otherwise
        DEFERRAL_WAIT_S, which lets the registration thread run at once."""
        deadline = None
        if not scheduler_output.total_num_scheduled_tokens:
            deadline = self._next_deadline()
        if deadline is None:
            self._idle_wait.reset()
            self._arrived.clear()
            return
        longest = self._idle_wait.current if self._idle_backoff else DEFERRAL_WAIT_S
        if self._arrived.wait(min(longest, max(0.0, deadline - time.monotonic()))):
            self._idle_wait.reset()
        elif self._idle_backoff:
            self._idle_wait.next()
        self._arrived.clear()  # whatever arrived is drained right after

    def _next_deadline(self) -> float | None:
        """When P's wait next changes by itself (a deferral ends, a hold expires), or None when
        P waits for something else too: work queued for the workers, transfers they have yet
        to report (those steps the workers throttle), or nothing at all."""
        if self._pending.flushes or self._pending.releases or self._pending.aborts:
            return None
        if any(p.released for p in self._by_req.values()):
            return None
        deadlines = [t + self._config.registration_wait_s for t in self._first_seen.values()]
        deadlines += [p.hold_deadline for p in self._by_req.values()
                      if p.finished and p.reg is None]
        return min(deadlines, default=None)

    def has_pending_work(self) -> bool:
        return any(p.finished for p in self._by_req.values())

    def shutdown(self) -> None:
        self._server.close()
        if self._bootstrap is not None:
            self._bootstrap.close()

    # ------------------------------------------------------------ internals
    def _task(self, p: _Prefill, upto: int) -> SendTask | None:
        assert p.reg is not None and p.peer is not None
        final = upto >= p.num_prompt_tokens
        src: list[list[int]] = []
        dst: list[list[int]] = []
        try:
            if len(p.reg.block_ids) != len(self._groups):
                raise BlockTableError(f"decode sent {len(p.reg.block_ids)} block tables for "
                                      f"{len(self._groups)} KV cache groups")
            for group, mine, theirs in zip(self._groups, p.block_ids, p.reg.block_ids):
                s, d = select_blocks(group, mine, theirs, sent_tokens=p.sent_tokens, upto=upto,
                                     start_token=p.reg.start_token,
                                     num_tokens=p.num_prompt_tokens, final=final)
                src.append(s)
                dst.append(d)
        except BlockTableError as e:
            logger.error("transfer %s: %s; aborting", p.transfer_id, e)
            self._pending.aborts.append((p.transfer_id, f"block tables do not cover the "
                                         f"prompt: {e}", p.peer))
            p.final_sent = True
            return None
        task = SendTask(
            req_id=p.req_id, transfer_id=p.transfer_id, peer=p.peer,
            src_blocks=src, dst_blocks=dst,
            final=final, new_tokens=upto - p.sent_tokens,
            streamed=(self._config.layerwise
                      and p.num_prompt_tokens >= self._config.min_prompt_tokens),
        )
        p.sent_tokens = upto
        p.final_sent = final
        return task

    def _flush(self, p: _Prefill) -> None:
        task = self._task(p, p.num_prompt_tokens)
        if task is not None:
            task.streamed = False
            self._pending.flushes.append(task)
        self._release(p)

    def _release(self, p: _Prefill) -> None:
        if not p.released:
            p.released = True
            self._pending.releases.append((p.req_id, p.transfer_id))

    def _attach(self, p: _Prefill, reg: Register) -> None:
        if not p.sequential:
            self._count_registration(late=p.finished)
        p.reg = reg
        p.peer = Peer(engine_id=reg.engine_id, tp_size=reg.tp_size,
                      data_endpoints=list(reg.data_endpoints))
        # D already holds [0, start_token); never write into its (shared, cached) blocks.
        p.sent_tokens = (reg.start_token // self._block_size) * self._block_size
        if reg.num_tokens != p.num_prompt_tokens:
            logger.warning("transfer %s: decode expects %d tokens, prefill has %d",
                           p.transfer_id, reg.num_tokens, p.num_prompt_tokens)
        if p.finished and not p.released:
            self._flush(p)
        self._push_first_token(p)

    def _push_first_token(self, p: _Prefill) -> None:
        """Once the request has finished and D has registered asking for it (either order)."""
        if p.reg is not None and p.reg.wants_first_token and p.first_token is not None:
            self._server.push(FirstToken(transfer_id=p.transfer_id, token_id=p.first_token))
            p.first_token = None  # sent once

    def _drain_incoming(self) -> None:
        while True:
            try:
                msg = self._incoming.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Register):
                p = self._by_tid.get(msg.transfer_id)
                if p is not None or msg.transfer_id in self._gone or \
                        msg.transfer_id in self._early_regs:
                    self._matched()  # attached or dropped now; otherwise held below
                gave_up = (msg.transfer_id in self._gone if p is None
                           else p.reg is None and p.released)
                if gave_up:
                    # acknowledged just as P gave up on it: tell D instead of leaving it waiting
                    self._server.forget(msg.transfer_id)
                    self._pending.aborts.append((
                        msg.transfer_id, "prefill stopped waiting for this registration",
                        Peer(msg.engine_id, msg.tp_size, list(msg.data_endpoints))))
                elif msg.transfer_id in self._early_regs:  # the registrar refuses a second one
                    logger.error("second early registration for transfer %s ignored",
                                 msg.transfer_id)
                elif p is None:
                    self._early_regs[msg.transfer_id] = (msg, time.monotonic())
                elif p.reg is None:
                    self._attach(p, msg)
                else:
                    logger.error("duplicate registration for transfer %s ignored",
                                 msg.transfer_id)
            else:
                self._cancel(msg)

    def _cancel(self, msg: Cancel) -> None:
        self._take_early(msg.transfer_id)
        self._server.forget(msg.transfer_id)
        p = self._by_tid.get(msg.transfer_id)
        if p is None:
            return
        logger.info("decode cancelled transfer %s: %s", msg.transfer_id, msg.reason)
        if p.peer is not None:
            self._pending.aborts.append((p.transfer_id, f"cancelled by decode: {msg.reason}",
                                         p.peer))
        p.final_sent = True  # nothing more to send
        if p.finished:
            self._release(p)

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._by_req.values() if p.finished and p.reg is None
                  and not p.released and now > p.hold_deadline]:
            logger.warning(
                "transfer %s: no decode registered within registration_timeout_s=%.0f s after "
                "prefill finished; freeing its blocks", p.transfer_id,
                self._config.registration_timeout_s)
            self._release(p)
        while self._early_regs:  # oldest first
            tid, (reg, at) = next(iter(self._early_regs.items()))
            if now - at <= self._early_ttl_s:
                break
            self._take_early(tid)
            self._server.forget(tid)
            self._mark_gone(tid)
            logger.warning("transfer %s: its prefill request did not arrive within "
                           "early_registration_ttl_s=%.0f s of the decode registration; "
                           "dropping the registration", tid, self._early_ttl_s)
            self._pending.aborts.append((
                tid, "the prefill request never reached the prefill instance",
                Peer(reg.engine_id, reg.tp_size, list(reg.data_endpoints))))
        while self._gone:
            tid, at = next(iter(self._gone.items()))
            if now - at <= self._early_ttl_s:
                break
            del self._gone[tid]

    def _answer(self, p: _Prefill) -> dict[str, object]:
        """What P's response carries in ``kv_transfer_params``. A sequential router copies it
        into the decode request as it is, so it holds all D needs to register."""
        params: dict[str, object] = {"transfer_id": p.transfer_id,
                                     "layerkv_endpoint": self.endpoint}
        if p.sequential:
            host, port = self.endpoint.rsplit(":", 1)
            params.update(do_remote_prefill=True, do_remote_decode=False, remote_host=host,
                          remote_port=int(port), remote_engine_id=self._engine_id)
        return params

    def _count_registration(self, late: bool) -> None:
        """Registrations that keep arriving after their prefill finished mean a sequential
        router: stop holding prefills back for them (LATE_REGISTRATION_STREAK)."""
        if not late:
            if self._late_registrations >= LATE_REGISTRATION_STREAK:
                logger.info("a decode registration arrived while its prefill ran: new prefills "
                            "wait for registrations again (registration_wait_s)")
            self._late_registrations = 0
            return
        self._late_registrations += 1
        if self._late_registrations == LATE_REGISTRATION_STREAK:
            self._say_sequential(f"{LATE_REGISTRATION_STREAK} decode registrations in a row "
                                 "arrived only after their prefill had finished (a router that "
                                 "sends the decode request after the prefill's answer)")

    def _say_sequential(self, why: str) -> None:
        """Once per instance: this contract cannot overlap the transfer with the prefill."""
        if not self._said_sequential:
            self._said_sequential = True
            logger.warning(
                "LayerKV: %s. KV moves once decode registers, after the prefill, with no "
                "overlap, and new prefills no longer wait for registrations. Routers that send "
                "the prefill and decode requests at once (vllm-layerkv proxy, llm-d's mooncake "
                "mode) stream KV during the prefill; docs/deployment.md", why)

    def _serve_bootstrap(self, dp_rank: int) -> BootstrapServer | None:
        """The bootstrap endpoint routers read (rank 0 serves it, other data-parallel ranks
        register with it). A port in use is logged, not fatal: LayerKV's own proxy does not
        need the endpoint."""
        port = self._config.bootstrap_port
        if dp_rank > 0:
            register_with(self._config.host, port, dp_rank, self._engine_id, self.endpoint,
                          self._auth)
            return None
        try:
            return BootstrapServer(self._config.host, port, dp_rank, self._engine_id,
                                   self.endpoint, self._auth, self._limits,
                                   query_auth=self._config.bootstrap_query_auth)
        except BootstrapError as e:
            logger.error("LayerKV: %s. Routers that read it (vllm-router --kv-connector "
                         "mooncake, llm-d's mooncake mode) cannot find this instance.", e)
            return None

    def _forget(self, p: _Prefill) -> None:
        self._server.forget(p.transfer_id)
        self._by_req.pop(p.req_id, None)
        self._by_tid.pop(p.transfer_id, None)
        self._mark_gone(p.transfer_id)

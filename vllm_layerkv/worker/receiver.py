"""Decode-side bookkeeping of incoming transfers (the transport's ReceiveSink).

Receiver threads (transport) and the worker's main thread share this table. The invariant that
keeps KV memory safe: a transfer's blocks are written only while the transfer is *open*, and a
transfer is reported to vLLM (finished or failed) only after it is closed and no write into it is
in progress. After that vLLM may hand the blocks to another request; late frames for a closed
transfer are read off the wire and dropped.

Early release (``early_release``): when P says a transfer is nearly done
(``TransferNearlyDone``, with an estimate of when), the worker may report the request to vLLM
*before* it is closed, so that vLLM's scheduling of it (a few engine-loop hops) overlaps P's last
layer group. The invariant above then holds through ``wait_early``: the step that runs such a
request waits, before its forward, until the transfer is closed; if it failed, its blocks are
reported as load errors in that very step (vLLM then recomputes or fails the request, per
``kv_load_failure_policy``). Reported early, a transfer is never reported again.

A transfer whose request continues from P's first token (``RecvTask.wants_first_token``) is
never reported early, and is closed only once its KV is all here *and* the scheduler has the
token (``token_arrived``): vLLM must not schedule the request before the token is appended.

Who may touch a transfer: every write, ``TransferNearlyDone``, ``TransferDone`` and
``TransferAbort`` names its ``Source`` (P's engine id, TP rank and size from the connection's
``Hello``, and the connection itself). The first (authenticated) connection that touches a
transfer for a P rank binds that rank's part of it: the transfer then belongs to that P engine,
takes that rank's data and completion only from that connection, and refuses every other
connection (its frames are dropped; it cannot complete, fail or abort the transfer). Losing a
connection fails only the transfers it was bound to. A ``TransferAbort`` for a transfer this
worker has not heard of yet waits for it as a frame does (``connect_timeout_s``), then binds it
like any other touch; nothing is kept to fail a transfer later.

Closed transfer ids are remembered (for ``closed_transfer_ttl_s``, at most
``max_closed_transfers``) so that late frames for them are dropped at once; a forgotten one is
treated as unknown, which is as safe: only open transfers are ever written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_layerkv.common.log import RateLimitedWarning, init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv import tp
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport.base import Source
from vllm_layerkv.wire.protocol import CompatInfo, Hello, TransferAck
from vllm_layerkv.wire.refusals import mismatch_refusal

logger = init_logger(__name__)
CLOSED_TTL_S = 600.0
MAX_CLOSED = 65536


@dataclass
class _Incoming:
    req_id: str
    transfer_id: str
    allowed_blocks: frozenset[int]
    t_expected: float
    engine_id: str | None = None
    """The P engine the transfer is bound to (by the first source that touched it)."""
    src_tp: int = 0
    bound: dict[int, int] = field(default_factory=dict)
    """P rank -> the link (connection) bound to carry that rank's part."""
    done_ranks: set[int] = field(default_factory=set)
    expected_ranks: set[int] | None = None
    writers: int = 0
    nbytes: int = 0
    ready_at: float | None = None
    """When P expects to be done, less the early-release lead (``on_nearly_done``)."""
    early: bool = False
    """Reported to vLLM before it closed (``take_early``)."""
    wants_token: bool = False
    has_token: bool = False
    complete: bool = False
    """Every source rank is done, but the first token has not come yet (``wants_token``)."""


class RecvTable:
    def __init__(self, compat: CompatInfo, tp_rank: int, tp_size: int, unknown_wait_s: float,
                 stats: WorkerStats, tracer: Tracer | None = None, early_lead_s: float = 0.0,
                 max_closed: int = MAX_CLOSED, closed_ttl_s: float = CLOSED_TTL_S):
        """``early_lead_s``: report a nearly done transfer this long before P expects to finish
        (``take_early``). ``max_closed`` / ``closed_ttl_s``: how many closed transfer ids are
        remembered, and how long (``max_closed_transfers`` / ``closed_transfer_ttl_s``)."""
        self.tp_rank = tp_rank
        self._early_lead_s = early_lead_s
        self._tracer = tracer or Tracer("", "d", tp_rank)
        self._tp_size = tp_size
        self._compat = compat
        self._unknown_wait_s = unknown_wait_s
        self._stats = stats
        self._cond = threading.Condition()
        self._open: dict[str, _Incoming] = {}
        self._closed: dict[str, float] = {}
        """transfer_id -> when it closed (or was given up as unknown), oldest first."""
        self._max_closed = max_closed
        self._closed_ttl_s = closed_ttl_s
        self._refusals = RateLimitedWarning(logger)
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._early_failed: dict[str, tuple[frozenset[int], float]] = {}
        """req_id -> (blocks, when): transfers reported early that then failed; their blocks
        become load errors in the step that runs the request (``wait_early``)."""
        self._load_errors: set[int] = set()
        self.results_ready = threading.Event()

    # ----------------------------------------------------------- worker thread
    def expect(self, task: RecvTask) -> None:
        with self._cond:
            inc = _Incoming(req_id=task.req_id, transfer_id=task.transfer_id,
                            allowed_blocks=frozenset(task.block_ids),
                            t_expected=time.monotonic(), wants_token=task.wants_first_token)
            self._open[task.transfer_id] = inc
            self._tracer.event("recv_expected", transfer_id=task.transfer_id)
            self._cond.notify_all()

    def close(self, transfer_id: str, failed: bool, reason: str) -> None:
        """Stop accepting KV for ``transfer_id`` and report its request: as failed, or (request
        already ended) as merely finished. No-op if it already completed: it is reported as
        finished, which frees its blocks just the same."""
        with self._cond:
            inc = self._open.get(transfer_id)
            if inc is not None:
                self._close_locked(inc, "failed" if failed else "cancelled", reason)

    def token_arrived(self, transfer_id: str) -> None:
        """The scheduler has P's first token for ``transfer_id``: close it if its KV is in."""
        with self._cond:
            inc = self._open.get(transfer_id)
            if inc is None:
                return
            inc.has_token = True
            if inc.complete:
                self._close_locked(inc, "ok", "")

    def drain(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed ⊆ finished is NOT
        implied here (the connector adds failed ones to finished for vLLM)."""
        with self._cond:
            finished, self._finished = self._finished, set()
            failed, self._failed = self._failed, set()
            self.results_ready.clear()
            now = time.monotonic()
            while self._closed:
                tid, at = next(iter(self._closed.items()))
                if now - at <= self._closed_ttl_s:
                    break
                del self._closed[tid]
            for req_id in [r for r, (_, at) in self._early_failed.items()
                           if now - at > self._closed_ttl_s]:
                del self._early_failed[req_id]  # the request ended before it ran
        return finished, failed

    def drain_failed_blocks(self, request_failures: bool) -> set[int]:
        """Block ids for ``get_block_ids_with_load_errors`` since the last call: those of
        early-reported requests whose transfer failed and which run in this step (always), and,
        with ``request_failures`` (vLLM 0.26, which has no request-level report), those of every
        other failed transfer."""
        with self._cond:
            blocks, self._load_errors = self._load_errors, set()
            failed, self._failed_blocks = self._failed_blocks, set()
        return blocks | failed if request_failures else blocks

    # ----------------------------------------------------------- early release
    def next_early_at(self) -> float | None:
        """When the next open transfer becomes ready to report early (None: none is)."""
        with self._cond:
            times = [inc.ready_at for inc in self._open.values()
                     if inc.ready_at is not None and not inc.early]
        return min(times, default=None)

    def take_early(self, now: float) -> set[str]:
        """Requests of open transfers whose ``ready_at`` has come: reported now, marked early
        (they are not reported again when they close)."""
        with self._cond:
            ready = [inc for inc in self._open.values()
                     if not inc.early and inc.ready_at is not None and inc.ready_at <= now]
            for inc in ready:
                inc.early = True
                self._tracer.event("recv_early", transfer_id=inc.transfer_id, req_id=inc.req_id)
        return {inc.req_id for inc in ready}

    def wait_early(self, req_ids: Sequence[str], timeout: float) -> None:
        """Before the forward of a step that runs ``req_ids`` (their first step after being
        reported): wait until every one of them reported early is closed; one still open after
        ``timeout`` is failed. A failed one's blocks become load errors of this step."""
        deadline = time.monotonic() + timeout
        wanted = set(req_ids)
        with self._cond:
            while True:
                waiting = [inc for inc in self._open.values()
                           if inc.early and inc.req_id in wanted]
                if not waiting:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    for inc in waiting:
                        self._close_locked(inc, "failed", "prefill said the transfer was "
                                           f"nearly done, then sent nothing for {timeout:.0f} s")
                    break
                self._cond.wait(left)
            for req_id in wanted:
                failed = self._early_failed.pop(req_id, None)
                if failed is not None:
                    self._load_errors |= failed[0]

    def pending(self) -> int:
        with self._cond:
            return len(self._open)

    def _close_locked(self, inc: _Incoming, outcome: str, reason: str) -> None:
        """Wait until no receiver thread writes into ``inc``, then finish it (if nobody else
        did meanwhile)."""
        while inc.writers:
            self._cond.wait()
        if inc.transfer_id in self._open:
            self._finish_locked(inc, outcome, reason)

    def _finish_locked(self, inc: _Incoming, outcome: str, reason: str) -> None:
        """outcome: "ok" (all KV arrived), "failed", or "cancelled" (the request ended)."""
        del self._open[inc.transfer_id]
        self._remember_closed_locked(inc.transfer_id)
        if inc.early:  # vLLM has it already: only a failure has more to say (wait_early)
            if outcome == "failed":
                logger.error("LayerKV transfer %s (request %s, released early) failed: %s",
                             inc.transfer_id, inc.req_id, reason)
                self._early_failed[inc.req_id] = (inc.allowed_blocks, time.monotonic())
                self._stats.record_failed()
            elif outcome == "ok":
                self._stats.record_received(inc.nbytes, time.monotonic() - inc.t_expected)
        elif outcome == "cancelled":
            self._finished.add(inc.req_id)
        elif outcome == "failed":
            logger.error("LayerKV transfer %s (request %s) failed: %s", inc.transfer_id,
                         inc.req_id, reason)
            self._failed.add(inc.req_id)
            self._failed_blocks |= inc.allowed_blocks
            self._stats.record_failed()
        else:
            self._finished.add(inc.req_id)
            self._stats.record_received(inc.nbytes, time.monotonic() - inc.t_expected)
        self._tracer.event("recv_closed", transfer_id=inc.transfer_id, req_id=inc.req_id,
                           outcome=outcome, nbytes=inc.nbytes)
        self.results_ready.set()
        self._cond.notify_all()

    # ----------------------------------------------------------- receiver threads
    @property
    def tp_size(self) -> int:
        return self._tp_size

    def check_hello(self, hello: Hello) -> str | None:
        """None to accept the sender; else the refusal it is sent, which names the fields that
        differ (the values go to this worker's log only)."""
        detail = tp.peer_error(self._compat, self._tp_size, hello.compat, hello.tp_size,
                               f"prefill {hello.engine_id}")
        if detail is None:
            return None
        logger.error("refusing LayerKV sender (prefill %s rank %d): %s", hello.engine_id,
                     hello.tp_rank, detail)
        return mismatch_refusal(self._compat, self._tp_size, hello.compat, hello.tp_size,
                                "decode")

    def begin_write(self, transfer_id: str, dst_blocks: Sequence[int], source: Source) -> bool:
        with self._cond:
            inc = self._wait_known_locked(transfer_id)
            if inc is None or not self._admit_locked(inc, source, "a write"):
                return False
            bad = [b for b in dst_blocks if b not in inc.allowed_blocks]
            if bad:
                self._close_locked(inc, "failed", f"prefill wrote to blocks {bad[:8]} that are "
                                                  "not allocated to this transfer")
                return False
            inc.writers += 1
            return True

    def end_write(self, transfer_id: str, nbytes: int = 0) -> None:
        with self._cond:
            inc = self._open.get(transfer_id)
            if inc is not None:
                inc.writers -= 1
                inc.nbytes += nbytes
            self._cond.notify_all()

    def on_done(self, transfer_id: str, src_rank: int, src_tp: int, frames: int,
                nbytes: int, source: Source | None = None) -> TransferAck | None:
        """``source``: the connection it came from (the transport always names it; None: this
        process itself, for P rank ``src_rank`` of ``src_tp``)."""
        with self._cond:
            inc = self._wait_known_locked(transfer_id)
            if inc is None:
                return TransferAck(transfer_id=transfer_id, ok=False,
                                   reason="decode no longer waits for this transfer")
            if source is not None and not self._admit_locked(inc, source, "TransferDone"):
                return TransferAck(transfer_id=transfer_id, ok=False,
                                   reason="this connection does not carry this transfer")
            if inc.expected_ranks is None:
                inc.expected_ranks = set(tp.source_ranks(self.tp_rank, self._tp_size, src_tp,
                                                         self._compat.total_kv_heads))
            inc.done_ranks.add(src_rank if source is None else source.tp_rank)
            if inc.done_ranks >= inc.expected_ranks and inc.wants_token and not inc.has_token:
                inc.complete = True  # closed by token_arrived
            elif inc.done_ranks >= inc.expected_ranks:
                self._close_locked(inc, "ok", "")
                if inc.req_id in self._failed:  # closed as failed by another path meanwhile
                    return TransferAck(transfer_id=transfer_id, ok=False,
                                       reason="closed while completing")
            # this source's KV is all here (its writes precede its TransferDone on the
            # connection): it may free its blocks, whether or not other ranks are done
            return TransferAck(transfer_id=transfer_id, ok=True)

    def on_nearly_done(self, transfer_id: str, src_rank: int, eta_s: float,
                       source: Source | None = None) -> None:
        """``source``: as for ``on_done`` (None: this process itself)."""
        with self._cond:
            inc = self._open.get(transfer_id)
            if inc is None or inc.early or inc.wants_token:
                return
            if source is not None and not self._admit_locked(inc, source,
                                                             "TransferNearlyDone"):
                return
            ready_at = time.monotonic() + eta_s - self._early_lead_s
            inc.ready_at = ready_at if inc.ready_at is None else min(inc.ready_at, ready_at)
        self.results_ready.set()  # a worker waiting on an idle step recomputes its wait

    def on_abort(self, transfer_id: str, reason: str, source: Source | None = None) -> None:
        """P gives up on the transfer; an abort that overtook the worker's ``RecvTask`` waits
        for it like a frame (``source`` None: this process's own decision)."""
        with self._cond:
            inc = self._wait_known_locked(transfer_id, "an abort")
            if inc is None:
                return
            if source is not None and not self._admit_locked(inc, source, "TransferAbort"):
                return
            self._close_locked(inc, "failed", f"prefill aborted the transfer: {reason}")

    def on_source_lost(self, source: Source, reason: str) -> None:
        """``source``'s connection ended: fail the transfers it was bound to and had not
        finished."""
        with self._cond:
            for inc in list(self._open.values()):
                if (inc.engine_id == source.engine_id
                        and inc.bound.get(source.tp_rank) == source.link
                        and source.tp_rank not in inc.done_ranks):
                    self._close_locked(inc, "failed", f"prefill rank {source.tp_rank}: {reason}")

    def _admit_locked(self, inc: _Incoming, source: Source, what: str) -> bool:
        """Whether ``source`` may touch ``inc``; the first source of each P rank binds it
        (``bound``), and the first of all binds the P engine and its TP size."""
        if inc.engine_id is None:
            try:
                ranks = tp.source_ranks(self.tp_rank, self._tp_size, source.tp_size,
                                        self._compat.total_kv_heads)
            except ValueError:
                ranks = []
            if source.tp_rank not in ranks:
                return self._refuse_locked(inc, source, what, "that prefill rank does not feed "
                                                              "this decode rank")
            inc.engine_id, inc.src_tp, inc.expected_ranks = (source.engine_id, source.tp_size,
                                                             set(ranks))
        elif source.engine_id != inc.engine_id or source.tp_size != inc.src_tp:
            return self._refuse_locked(inc, source, what, "another prefill engine carries it")
        elif source.tp_rank not in (inc.expected_ranks or ()):
            return self._refuse_locked(inc, source, what, "that prefill rank does not feed "
                                                          "this decode rank")
        link = inc.bound.setdefault(source.tp_rank, source.link)
        if link != source.link:
            return self._refuse_locked(inc, source, what, "another connection carries that "
                                                          "prefill rank's part of it")
        return True

    def _refuse_locked(self, inc: _Incoming, source: Source, what: str, why: str) -> bool:
        self._refusals.warning("LayerKV: refused %s for transfer %s from prefill %s rank %d: "
                               "%s", what, inc.transfer_id, source.engine_id, source.tp_rank,
                               why)
        return False

    def _remember_closed_locked(self, transfer_id: str) -> None:
        self._closed.pop(transfer_id, None)
        self._closed[transfer_id] = time.monotonic()
        while len(self._closed) > self._max_closed:
            del self._closed[next(iter(self._closed))]

    def _wait_known_locked(self, transfer_id: str, what: str = "KV") -> _Incoming | None:
        """The open transfer, waiting briefly if P is faster than this worker learning about
        it from its scheduler (the registration goes to P before the worker's next step)."""
        deadline = time.monotonic() + self._unknown_wait_s
        while True:
            inc = self._open.get(transfer_id)
            if inc is not None or transfer_id in self._closed:
                return inc
            left = deadline - time.monotonic()
            if left <= 0:
                self._refusals.warning("dropping %s for unknown transfer %s", what,
                                       transfer_id)
                self._remember_closed_locked(transfer_id)
                return None
            self._cond.wait(left)

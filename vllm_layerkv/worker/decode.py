"""Decode-side worker: listens for prefill ranks, lets the transport write KV straight into this
worker's blocks, and reports each request as received (or failed) exactly once.

With ``early_release`` a request may be reported while P computes its last layer group, on steps
where this instance has nothing else to run; the first step that runs it then waits for the
transfer to close before its forward (``receiver.py``)."""

from __future__ import annotations

import time

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.transport.base import Transport
from vllm_layerkv.wire.protocol import CompatInfo
from vllm_layerkv.worker.receiver import RecvTable


def early_release_applies(enabled: bool, kv_cache_groups: int, tp_size: int,
                          device_type: str) -> tuple[bool, str]:
    """Whether this decode worker may report requests early, and why not.

    * vLLM takes load errors per block only for models with one KV cache group, and a request
      reported early can fail only that way (it runs already).
    * Not with host-memory KV at TP > 1: a rank that already has its KV enters the forward and
      spins in the CPU all-reduce while another rank waits for its last group. A prefill
      instance sharing that core (small hosts, the CI layout P TP1 -> D TP2 on two cores) then
      barely runs, so the last group comes only after the wait times out (seen: 60 s, then
      the request failed). On GPUs the collective waits on the device, not the host.
    """
    if not enabled:
        return False, "early_release is off"
    if kv_cache_groups != 1:
        return False, f"the model has {kv_cache_groups} KV cache groups"
    if tp_size > 1 and device_type != "cuda":
        return False, f"KV in host memory at TP {tp_size}"
    return True, ""


class DecodeWorker:
    def __init__(self, config: LayerKVConfig, blocks: BlockIO, transport: Transport,
                 compat: CompatInfo, tp_rank: int, tp_size: int, stats: WorkerStats,
                 tracer: Tracer):
        self._tracer = tracer
        self._table = RecvTable(compat, tp_rank, tp_size,
                                unknown_wait_s=config.connect_timeout_s, stats=stats,
                                tracer=tracer, early_lead_s=config.early_release_lead_ms / 1e3,
                                max_closed=config.max_closed_transfers,
                                closed_ttl_s=config.closed_transfer_ttl_s)
        self._early_wait_s = config.io_timeout_s
        port = config.data_port + tp_rank if config.data_port else 0
        self.endpoint = transport.start_receiver(
            config.host, port, self._table, blocks, config.io_timeout_s)

    def bind(self, meta: LayerKVMetadata) -> None:
        for task in meta.recvs:
            self._table.expect(task)
        for close in meta.recv_closes:
            self._table.close(close.transfer_id, close.failed, close.reason)
        for transfer_id in meta.first_tokens:
            self._table.token_arrived(transfer_id)
        if meta.first_steps:  # before the forward: KV of requests reported early must be in
            self._table.wait_early(meta.first_steps, self._early_wait_s)

    def results(self, wait_s: float = 0.0, early: bool = False) -> tuple[set[str], set[str]]:
        """(finished, failed) since last call. ``wait_s`` > 0 on idle steps: block that long
        for a completion instead of letting the engine loop spin. ``early``: also report
        transfers P said are nearly done, once their time has come (and wait no longer than
        that)."""
        if early and (ready_at := self._table.next_early_at()) is not None:
            wait_s = min(wait_s, max(0.0, ready_at - time.monotonic()))
        if wait_s > 0 and self._table.pending() and not self._table.results_ready.is_set():
            self._table.results_ready.wait(wait_s)
        finished, failed = self._table.drain()
        if early:
            finished |= self._table.take_early(time.monotonic())
        if self._tracer.enabled and (finished or failed):
            self._tracer.event("recv_reported", req_ids=sorted(finished | failed))
            self._tracer.flush()
        return finished, failed

    def pending(self) -> bool:
        """Transfers this worker still expects."""
        return self._table.pending() > 0

    def failed_blocks(self, request_failures: bool) -> set[int]:
        return self._table.drain_failed_blocks(request_failures)

"""Prefill-side worker: turns each step's send tasks into layer-group work items as the forward
pass runs, and tells vLLM when a finished request's blocks may be freed.

Per step:

* ``bind`` (before the forward; 0.32+ runs ``start_load_kv`` after it, so nothing per-step may
  live there) plans the step's layer groups and pre-builds one ``GroupSend`` per group, so the
  hook has nothing to allocate.
* ``on_layer_saved`` (the per-layer hook, hot path): a dict lookup; when the layer ends a group,
  record a device event (GPU) and enqueue that group, plus any earlier group whose hook was
  skipped. Never waits, never touches the network.
* ``end_step`` (``wait_for_save``): enqueue groups whose hooks never fired (FULL CUDA-graph
  replays skip them), the tasks that are sent whole at the end of the step (short prompts), and
  ``TransferDone`` for transfers whose last chunk this was.

In a step that ends a transfer, the sender follows the penultimate group with
``TransferNearlyDone`` (and an estimate of when the rest lands), so that an idle decode
instance can have vLLM schedule the request while the last group is computed and copied
(``early_release``, decode side in ``receiver.py``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.tasks import SendTask
from vllm_layerkv.worker.grouping import plan_groups
from vllm_layerkv.worker.sender import AbortTransfer, FinishTransfer, GroupSend, Sender

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)


def _new_event(device_type: str, timing: bool = False) -> torch.cuda.Event | None:
    """A device event for one group (created in bind, recorded by the hook). None on CPU:
    CPU attention runs synchronously, the KV is in memory when the hook runs.

    Blocking: the sender thread waits on it for as long as the group computes, tens to
    hundreds of ms. A default event's ``synchronize`` spins a CPU core all that time (CUDA's
    automatic scheduling spins while the host has more cores than active contexts); a
    blocking one sleeps until the device signals it, which costs microseconds on wake-up.
    ``timing``: the device's time between two events can be read (tracing, and steps that
    end a transfer: the ``TransferNearlyDone`` estimate)."""
    if device_type != "cuda":
        return None
    import torch

    if timing:
        return torch.cuda.Event(blocking=True, enable_timing=True)
    return torch.cuda.Event(blocking=True)


def _record(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.record()  # on the current (compute) stream; the sender waits on it, not us


class PrefillWorker:
    def __init__(self, config: LayerKVConfig, layout: KVLayout, sender: Sender, tracer: Tracer,
                 stats: WorkerStats) -> None:
        self._config = config
        self._stats = stats
        self._layout = layout
        self._sender = sender
        self._tracer = tracer
        self._device_type = layout.device.type
        self._step = 0
        # per-step plan (reset in bind)
        self._group_items: list[GroupSend] = []
        self._group_of_end_layer: dict[str, int] = {}
        self._next_group = 0
        self._end_of_step_tasks: list[SendTask] = []
        self._final_tasks: list[SendTask] = []
        # releases waiting for their transfer to become terminal: req_id -> (tid, deadline)
        self._releases: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------------ per step
    def bind(self, meta: LayerKVMetadata) -> None:
        self._step += 1
        for tid, reason, peer in meta.aborts:
            self._sender.put(AbortTransfer(tid, reason, peer))
        for task in meta.flushes:  # KV computed in earlier steps: send it all now
            self._sender.outgoing(task)
            self._sender.put(GroupSend(self._step, 0, list(range(self._layout.num_layers)),
                                       [task]))
            if task.final:
                self._sender.put(FinishTransfer(task, t_compute_end=0.0))
        now = time.monotonic()
        for req_id, tid in meta.releases:
            self._releases[req_id] = (tid, now + self._config.ack_timeout_s)

        streamed = [t for t in meta.sends if t.streamed]
        self._end_of_step_tasks = [t for t in meta.sends if not t.streamed]
        self._final_tasks = [t for t in meta.sends if t.final]
        for task in meta.sends:
            self._sender.outgoing(task)
        self._next_group = 0
        if not streamed:
            self._group_items = []
            self._group_of_end_layer = {}
            return
        num_layers = self._layout.num_layers
        avg_tokens = sum(t.new_tokens for t in streamed) // len(streamed)
        transfer_s = self._sender.link_rate.seconds_for(self._step_bytes(streamed))
        groups, announce = plan_groups(num_layers, avg_tokens, self._config, transfer_s)
        # a step that ends a transfer announces the end to D before its last (even) group
        ends_transfer = any(t.final for t in streamed)
        # timing events: the trace's group_ready, and how long the layers before the
        # announcement took on the device, from which the sender estimates when the rest is done
        timing = self._tracer.enabled or ends_transfer
        step_start = _new_event(self._device_type, timing=True) if timing else None
        _record(step_start)
        t_planned = time.monotonic()
        self._group_items = [GroupSend(self._step, i, list(g), streamed,
                                       event=_new_event(self._device_type, timing),
                                       announces_end=ends_transfer and i == announce,
                                       layers_through=g[-1] + 1, num_layers=num_layers,
                                       t_planned=t_planned, step_start=step_start)
                             for i, g in enumerate(groups)]
        names = self._layout.layer_names
        self._group_of_end_layer = {names[g[-1]]: i for i, g in enumerate(groups)}
        if self._tracer.enabled:
            self._tracer.event("step_plan", step=self._step, groups=len(groups),
                               tokens=avg_tokens, tasks=len(streamed),
                               transfer_ms=round(transfer_s * 1e3, 2),
                               transfer_ids=[t.transfer_id for t in streamed],
                               final=[t.transfer_id for t in streamed if t.final])

    def _step_bytes(self, tasks: list[SendTask]) -> int:
        """This rank's KV of the step's new blocks, all layers (what the step puts on the
        link; with TP different on D, the head slices add up to the same)."""
        blocks = sum(max((len(b) for b in t.src_blocks), default=0) for t in tasks)
        return blocks * self._layout.block_bytes * self._layout.num_layers

    def on_layer_saved(self, layer_name: str) -> None:
        group = self._group_of_end_layer.get(layer_name)
        if group is None or group < self._next_group:
            return
        for g in range(self._next_group, group + 1):
            item = self._group_items[g]
            _record(item.event)
            self._sender.put(item)
        self._next_group = group + 1
        if self._tracer.enabled:
            self._tracer.event("group_enqueued", step=self._step, group=group, layer=layer_name)

    def end_step(self) -> None:
        if not (self._group_items or self._end_of_step_tasks or self._final_tasks):
            return
        t_end = time.monotonic()
        self._tracer.event("step_end", step=self._step)
        # groups whose hooks never fired (FULL CUDA-graph replays skip them)
        for g in range(self._next_group, len(self._group_items)):
            _record(self._group_items[g].event)
            self._sender.put(self._group_items[g])
        if self._end_of_step_tasks:
            event = _new_event(self._device_type)
            _record(event)
            self._sender.put(GroupSend(self._step, 0, list(range(self._layout.num_layers)),
                                       self._end_of_step_tasks, event=event))
        for task in self._final_tasks:
            self._sender.put(FinishTransfer(task, t_compute_end=t_end))
        self._group_items, self._group_of_end_layer = [], {}
        self._end_of_step_tasks, self._final_tasks = [], []
        self._next_group = 0

    # ------------------------------------------------------------------ completions
    def finished_sending(self) -> set[str]:
        """Requests whose held blocks vLLM may free now."""
        if not self._releases:
            return set()
        done: set[str] = set()
        now = time.monotonic()
        state = self._sender.state
        with state.lock:
            for req_id, (tid, deadline) in list(self._releases.items()):
                out = state.transfers.get(tid)
                # a posted write may still read the blocks (a device copy): not before it landed
                if out is None or (out.terminal and not out.writes_posted):
                    done.add(req_id)
                elif now > deadline and not out.in_use and not out.writes_posted:
                    logger.warning(
                        "LayerKV transfer %s (request %s): no acknowledgement from decode "
                        "within ack_timeout_s=%.0f s (state %s); freeing its blocks",
                        tid, req_id, self._config.ack_timeout_s, out.state)
                    out.state, out.reason = "failed", "ack timeout"
                    self._stats.record_failed()
                    done.add(req_id)
                if req_id in done:
                    del self._releases[req_id]
                    state.transfers.pop(tid, None)
        return done

    def has_pending(self) -> bool:
        return bool(self._releases)

"""Prefill-side sender thread: drains the work queue the layer hooks fill and pushes KV to decode.

The forward pass only enqueues (``SendQueue.put`` is a lock-free ``SimpleQueue.put``); this
thread does everything that can wait: waiting for the GPU to finish writing a group (a device
event recorded by the hook; None on CPU, where the hook runs after the synchronous kernel),
opening connections, and the writes themselves. One thread keeps every transfer's frames in
order on its connection, which the "re-send the partially filled block next chunk" rule needs.

Per-transfer state (``Outgoing``) is shared with the worker thread, which reports a finished
request to vLLM only once its transfer is *terminal* (acknowledged by D, failed, or aborted) and
this thread is not touching its blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_layerkv import tp
from vllm_layerkv.blockio import BlockIO
from vllm_layerkv.metadata import Peer, SendTask
from vllm_layerkv.protocol import Hello, TransferAck
from vllm_layerkv.stats import WorkerStats
from vllm_layerkv.trace import Tracer
from vllm_layerkv.transport.base import SendChannel, Transport, TransportError

logger = logging.getLogger("vllm.layerkv.sender")


@dataclass
class GroupSend:
    """Write layers ``layers`` of every task's blocks (one frame per task)."""

    step: int
    group: int
    layers: list[int]
    tasks: list[SendTask]
    event: Any = None
    """Device event recorded after the group's last layer (None on CPU)."""


@dataclass
class FinishTransfer:
    """Everything for ``task.transfer_id`` is written: send TransferDone."""

    task: SendTask
    t_compute_end: float


@dataclass
class AbortTransfer:
    transfer_id: str
    reason: str
    peer: Peer


WorkItem = GroupSend | FinishTransfer | AbortTransfer


@dataclass
class Outgoing:
    transfer_id: str
    req_id: str
    endpoint: str
    state: str = "open"  # open -> done_sent -> acked | failed | aborted
    reason: str = ""
    frames: int = 0
    nbytes: int = 0
    t_first: float = 0.0
    t_done_sent: float = 0.0
    in_use: bool = False
    """The sender thread is reading this transfer's source blocks right now."""

    @property
    def terminal(self) -> bool:
        return self.state in ("acked", "failed", "aborted")


@dataclass
class SenderState:
    """What the sender thread shares with the worker thread (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    transfers: dict[str, Outgoing] = field(default_factory=dict)
    changed: threading.Event = field(default_factory=threading.Event)


class Sender:
    def __init__(self, transport: Transport, blocks: BlockIO, hello: Hello,
                 tp_rank: int, connect_timeout: float, io_timeout: float, stats: WorkerStats,
                 tracer: Tracer, layer_groups: list[int] | None = None,
                 final_only_groups: dict[int, str] | None = None):
        """``layer_groups``: KV cache group of each layer index (all 0 if None);
        ``final_only_groups``: group -> kind for the groups that send once, at the end
        (sliding window, Mamba state), traced as ``final_group_sent``."""
        self._layer_groups = layer_groups or [0] * blocks.num_layers
        self._final_only_groups = dict(final_only_groups or {})
        self._transport = transport
        self._blocks = blocks
        self._hello = hello
        self._tp_rank = tp_rank
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._stats = stats
        self._tracer = tracer
        self.state = SenderState()
        self._queue: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self._channels: dict[str, SendChannel] = {}
        self._thread = threading.Thread(target=self._run, name="layerkv-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def put(self, item: WorkItem) -> None:
        self._queue.put(item)

    def outgoing(self, task: SendTask) -> None:
        """Create the transfer's state before its first item is queued (worker thread)."""
        with self.state.lock:
            if task.transfer_id not in self.state.transfers:
                endpoint = task.peer.data_endpoints[self._target_rank(task)]
                self.state.transfers[task.transfer_id] = Outgoing(
                    transfer_id=task.transfer_id, req_id=task.req_id, endpoint=endpoint)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        for ch in self._channels.values():
            ch.close()

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, GroupSend):
                    self._send_group(item)
                elif isinstance(item, FinishTransfer):
                    self._finish(item)
                else:
                    self._abort(item)
            except Exception:  # noqa: BLE001 - never let the thread die silently
                logger.exception("LayerKV sender failed on %s", type(item).__name__)
            self._tracer.flush()

    def _send_group(self, item: GroupSend) -> None:
        if item.event is not None:
            item.event.synchronize()  # KV of this group is written on the device
        t0 = time.monotonic()
        self._tracer.event("group_send_start", step=item.step, group=item.group,
                           layers=len(item.layers))
        by_group = self._layers_by_group(item.layers)
        for task in item.tasks:
            out = self._claim(task.transfer_id)
            if out is None:
                continue
            try:
                channel = self._channel(out.endpoint)
                # one frame per KV cache group: each group has its own block table
                for group, layers in by_group:
                    src, dst = task.src_blocks[group], task.dst_blocks[group]
                    if not src:
                        continue
                    t = time.monotonic()
                    n = channel.write_blocks(task.transfer_id, layers, src, dst)
                    self._stats.record_group(n, time.monotonic() - t)
                    out.frames += 1
                    out.nbytes += n
                    if not out.t_first:
                        out.t_first = t
                    if group in self._final_only_groups and self._tracer.enabled:
                        self._tracer.event("final_group_sent", transfer_id=task.transfer_id,
                                           step=item.step, kv_group=group,
                                           kind=self._final_only_groups[group],
                                           layers=list(layers), blocks=len(src))
            except TransportError as e:
                self._set_state(out, "failed", str(e))
                self._tell_decode_failed(out, str(e))
            finally:
                out.in_use = False
        self._tracer.event("group_send_end", step=item.step, group=item.group,
                           seconds=time.monotonic() - t0)

    def _layers_by_group(self, layers: list[int]) -> list[tuple[int, list[int]]]:
        """``layers`` split by KV cache group, in order of first appearance."""
        out: dict[int, list[int]] = {}
        for layer in layers:
            out.setdefault(self._layer_groups[layer], []).append(layer)
        return list(out.items())

    def _finish(self, item: FinishTransfer) -> None:
        out = self._claim(item.task.transfer_id)
        if out is None:
            return
        try:
            self._channel(out.endpoint).send_done(out.transfer_id, self._tp_rank, out.frames,
                                                  out.nbytes)
            now = time.monotonic()
            exposed = max(0.0, now - item.t_compute_end) if item.t_compute_end else None
            self._stats.record_sent(exposed)
            self._tracer.event("transfer_done_sent", transfer_id=out.transfer_id,
                               frames=out.frames, nbytes=out.nbytes, exposed=exposed)
            with self.state.lock:
                if out.state == "open":
                    out.state = "done_sent"
                    out.t_done_sent = now
        except TransportError as e:
            self._set_state(out, "failed", str(e))
        finally:
            out.in_use = False

    def _abort(self, item: AbortTransfer) -> None:
        with self.state.lock:
            out = self.state.transfers.get(item.transfer_id)
        endpoint = (out.endpoint if out is not None
                    else item.peer.data_endpoints[self._target_rank_of(item.peer)])
        if out is None or out.state in ("open", "done_sent"):
            # D may be waiting for this transfer even if nothing was sent yet: tell it
            try:
                self._channel(endpoint).send_abort(item.transfer_id, item.reason)
            except TransportError as e:
                logger.warning("could not tell decode %s that transfer %s was aborted: %s",
                               endpoint, item.transfer_id, e)
        if out is not None:
            self._set_state(out, "aborted", item.reason, force=True)

    def _tell_decode_failed(self, out: Outgoing, reason: str) -> None:
        """A write failed on this side (a device copy, an injected fault) while the connection
        is still up: abort the transfer on D now, or D would wait for kv_wait_timeout_s."""
        channel = self._channels.get(out.endpoint)
        if channel is None or not channel.alive:
            return  # connection lost: D fails the transfer itself
        try:
            channel.send_abort(out.transfer_id, f"prefill could not send its KV: {reason}")
        except TransportError:
            pass

    def _claim(self, transfer_id: str) -> Outgoing | None:
        """The transfer's state marked in use, or None if it is no longer sendable."""
        with self.state.lock:
            out = self.state.transfers.get(transfer_id)
            if out is None or out.state != "open":
                return None
            out.in_use = True
            return out

    def _channel(self, endpoint: str) -> SendChannel:
        ch = self._channels.get(endpoint)
        if ch is not None and ch.alive:
            return ch
        if ch is not None:
            ch.close()
        ch = self._transport.open_channel(
            endpoint, self._hello, self._blocks,
            on_ack=self._on_ack,
            on_lost=lambda reason, ep=endpoint: self._on_lost(ep, reason),
            timeout=self._connect_timeout,
            io_timeout=self._io_timeout,
        )
        self._channels[endpoint] = ch
        return ch

    # ------------------------------------------------------------------ ack-reader threads
    def _on_ack(self, ack: TransferAck) -> None:
        with self.state.lock:
            out = self.state.transfers.get(ack.transfer_id)
        if out is None:
            return
        if ack.ok:
            self._set_state(out, "acked", "")
        else:
            self._set_state(out, "failed", f"decode dropped the transfer: {ack.reason}")

    def _on_lost(self, endpoint: str, reason: str) -> None:
        with self.state.lock:
            affected = [o for o in self.state.transfers.values()
                        if o.endpoint == endpoint and not o.terminal]
        for out in affected:
            self._set_state(out, "failed", reason)

    def _set_state(self, out: Outgoing, state: str, reason: str, force: bool = False) -> None:
        with self.state.lock:
            if out.terminal and not force:
                return
            out.state, out.reason = state, reason
        if state == "failed":
            logger.error("LayerKV transfer %s (request %s) to %s failed: %s", out.transfer_id,
                         out.req_id, out.endpoint, reason)
            self._stats.record_failed()
        self.state.changed.set()

    def _target_rank(self, task: SendTask) -> int:
        return self._target_rank_of(task.peer)

    def _target_rank_of(self, peer: Peer) -> int:
        return tp.target_ranks(self._tp_rank, self._hello.tp_size, peer.tp_size)[0]

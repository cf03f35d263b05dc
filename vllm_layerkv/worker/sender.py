"""Prefill-side sender thread: drains the work queue the layer hooks fill and pushes KV to decode.

The forward pass only enqueues (``SendQueue.put`` is a lock-free ``SimpleQueue.put``); this
thread does everything that can wait: waiting for the GPU to finish writing a group (a device
event recorded by the hook; None on CPU, where the hook runs after the synchronous kernel),
opening connections, and the writes themselves. One thread keeps every transfer's frames in
order on its connection, which the "re-send the partially filled block next chunk" rule needs.

Per-transfer state (``Outgoing``) is shared with the worker thread, which reports a finished
request to vLLM only once its transfer is *terminal* (acknowledged by D, failed, or aborted) and
this thread is not touching its blocks.

Where it sends is ``tp.routes``: with equal TP, whole blocks to the decode rank of the same
index; with different TP, each decode rank that needs some of this rank's KV heads gets its
head slice, gathered per layer group into a staging buffer (``staging.py``) and sent in one
transfer per (group, rank); through a direct plane's receive ring (and with ``host_bounce``,
whole blocks too), up to ``writes_in_flight`` such transfers are in flight at once.

Ring writes stay in flight from one layer group to the next (``PostedWrite``): on a link slower
than the prefill, a group is often one layer and one write, and waiting for each group's write
to land before posting the next would leave the link idle while the next write is gathered and
granted (measured on one H200 over UCX tcp: 16-17 ms per 32 MiB layer, where the wire alone
takes 7). They land in the order they were posted, so D, which scatters a ring slot when P
reports it, applies a later chunk's copy of a block after the earlier one. Every posted write
has landed before its transfer's ``TransferDone`` or abort goes out, and when the sender has
nothing else to do it lands the oldest.

A transfer with several decode ranks is acknowledged when every one of them acknowledged it,
and fails (on all of them) when one fails.

A transfer stays on the connection its first message went on (``Outgoing.links``), as D binds
it there: when that connection is lost, the transfer fails rather than go on over a new one, and
word of the loss fails only the transfers the lost connection carried. A loss can be reported
after the sender has opened the next connection and started the next transfer on it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import start_thread
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig, pipeline_depth
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv import fused_copy, staging, tp
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.tasks import Peer, SendTask
from vllm_layerkv.transport.base import (
    PendingWrite,
    SendChannel,
    Transport,
    TransportError,
)
from vllm_layerkv.wire.protocol import Hello, TransferAck
from vllm_layerkv.worker.link_rate import LinkRate

logger = init_logger(__name__)


@dataclass
class GroupSend:
    """Write layers ``layers`` of every task's blocks (one frame per task)."""

    step: int
    group: int
    layers: list[int]
    tasks: list[SendTask]
    event: torch.cuda.Event | None = None
    """Device event recorded after the group's last layer (None on CPU)."""
    announces_end: bool = False
    """The group after which only the last group of the even split is left (``plan_groups``),
    in a step that ends some of ``tasks``: once it is sent, tell D those transfers are nearly
    done (``TransferNearlyDone``)."""
    layers_through: int = 0
    """Layers of the step computed once this group is (for the remaining-time estimate)."""
    num_layers: int = 0
    t_planned: float = 0.0
    """When the worker planned the step (just before the forward; ``time.monotonic``)."""
    step_start: torch.cuda.Event | None = None
    """On GPU, in a step that ends a transfer or with tracing on: a timing event recorded when
    the step was planned. The device's time from it to ``event`` is what the step's layers so
    far took (``_announce_end``); the host's clock since ``t_planned`` can count more, since
    with asynchronous scheduling vLLM plans a step while the one before it still runs on the
    device. The trace also says when the group was ready on the device (``group_ready``),
    not only when this thread got to it."""


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
    routes: list[tuple[str, tp.Route]]
    """(data endpoint, route) per decode rank this worker feeds; empty when it feeds none
    (another rank holds the same KV heads), which makes the transfer terminal at once."""
    state: str = "open"  # open -> done_sent -> acked | failed | aborted
    reason: str = ""
    frames_to: dict[str, int] = field(default_factory=dict)
    """Transfer operations (frames, direct writes) per endpoint: D checks the count."""
    nbytes_to: dict[str, int] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    links: dict[str, int] = field(default_factory=dict)
    """Per endpoint, the number of the connection (``Sender._channel``) its messages go on."""
    t_first: float = 0.0
    t_done_sent: float = 0.0
    in_use: bool = False
    """The sender thread is reading this transfer's source blocks right now."""
    writes_posted: int = 0
    """Ring writes posted and not landed yet (a device copy of them may still read the source
    blocks: CUDA IPC gathers on a stream)."""

    @property
    def endpoints(self) -> list[str]:
        return [endpoint for endpoint, _ in self.routes]

    @property
    def frames(self) -> int:
        return sum(self.frames_to.values())

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_to.values())

    @property
    def endpoint(self) -> str:
        """For logs."""
        return ",".join(self.endpoints) or "(no decode rank)"

    @property
    def terminal(self) -> bool:
        return self.state in ("acked", "failed", "aborted")


@dataclass
class PostedWrite:
    """A ring write posted and not landed yet: it holds staging buffer ``buf`` and a ring
    slot on D until ``channel.finish_slices`` has reported it."""

    out: Outgoing
    endpoint: str
    channel: SendChannel
    t_start: float
    """When the sender took its staging buffer (``time.monotonic``)."""
    buf: torch.Tensor
    pending: PendingWrite


@dataclass
class SenderState:
    """What the sender thread shares with the worker thread (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    transfers: dict[str, Outgoing] = field(default_factory=dict)
    changed: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class SenderParts:
    """What a ``Sender`` works with: where it sends through, what it reads, what it tells
    decode, where it reports."""

    transport: Transport
    blocks: BlockIO
    hello: Hello
    """This prefill rank's greeting to every decode rank; its ``tp_rank`` and ``tp_size`` are
    the sender's own."""
    stats: WorkerStats
    tracer: Tracer
    layer_groups: list[int] | None = None
    """KV cache group of each layer index (all 0 if None)."""
    final_only_groups: dict[int, str] | None = None
    """Group -> kind for the groups that send once, at the end (sliding window, Mamba state),
    traced as ``final_group_sent``."""


@dataclass(frozen=True)
class SenderTuning:
    """How a ``Sender`` waits and buffers: ``LayerKVConfig``'s settings (``from_config``)."""

    connect_timeout_s: float
    io_timeout_s: float
    tp_staging: bool = True
    """How head slices go when the decode peer's TP differs (``LayerKVConfig.tp_staging``)."""
    staging_bytes: int = 64 << 20
    """One staging buffer, in bytes."""
    staging_buffers: int = 0
    """0: ``config.pipeline_depth`` for the transport (4 with host_bounce, else 2)."""
    writes_in_flight: int = 0
    """Ring writes kept in flight (at most one per staging buffer); 0 as above."""

    @classmethod
    def from_config(cls, config: LayerKVConfig) -> SenderTuning:
        return cls(connect_timeout_s=config.connect_timeout_s,
                   io_timeout_s=config.io_timeout_s, tp_staging=config.tp_staging,
                   staging_bytes=config.staging_buffer_mb << 20,
                   staging_buffers=config.staging_buffers,
                   writes_in_flight=config.writes_in_flight)


class Sender:
    def __init__(self, parts: SenderParts, tuning: SenderTuning) -> None:
        self._tp_staging = tuning.tp_staging
        bounce = parts.transport.host_bounce
        buffers = pipeline_depth(tuning.staging_buffers, bounce)
        self._staging_shape = (buffers, tuning.staging_bytes)
        self._writes_in_flight = min(pipeline_depth(tuning.writes_in_flight, bounce), buffers)
        self._staging: staging.StagingPool | None = None
        """Made at start-up with ``host_bounce``, else on the first head-slice send (equal TP
        over a GPU-direct path never pays for it)."""
        self._route_cache: dict[int, list[tp.Route]] = {}
        self._layer_groups = parts.layer_groups or [0] * parts.blocks.num_layers
        self._final_only_groups = dict(parts.final_only_groups or {})
        self._transport = parts.transport
        self._blocks = parts.blocks
        self._hello = parts.hello
        self._tp_rank = parts.hello.tp_rank
        self._connect_timeout = tuning.connect_timeout_s
        self._io_timeout = tuning.io_timeout_s
        self._stats = parts.stats
        self._tracer = parts.tracer
        self.state = SenderState()
        self.link_rate = LinkRate()
        """The rate this sender's groups move at (read by the group planner)."""
        self._group_bytes = 0
        """Bytes the current group wrote synchronously (ring writes are timed as they land)."""
        self._posted: deque[PostedWrite] = deque()
        """Ring writes in flight, oldest first, across groups and transfers."""
        self._last_landed = 0.0
        self._failed_unannounced: dict[str, tuple[Outgoing, str]] = {}
        """Transfers a landing write failed, whose abort waits for their other posted writes."""
        self._queue: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self._channels: dict[str, SendChannel] = {}
        self._links: dict[str, int] = {}
        """Per endpoint, the number of its current connection (numbers are never reused)."""
        self._link_numbers = itertools.count(1)
        if self._transport.host_bounce:
            self._prepare_bounce()
        self._thread = start_thread(self._run, "layerkv-sender")

    def _prepare_bounce(self) -> None:
        """Start-up, when sends may go through staging and host memory (``host_bounce``):
        make the staging pool, let the transport register it (or make its pinned host twins),
        and compile the gather kernel now. Left to the first request, these cost it about
        0.6 s on an H200 (docs/benchmarks.md, "the first request")."""
        t = time.monotonic()
        try:
            pool = self._staging_pool()
            self._transport.prepare_staging(pool.buffers)
            launches = fused_copy.warm_up(self._blocks.block_bytes,
                                          self._blocks.tensors[0].device, to_buf=True)
        except Exception as e:  # noqa: BLE001 - engines raise their own types
            # the first request tries again, and fails its transfer saying why if it must
            logger.warning("LayerKV: could not prepare host_bounce at start-up (%s); the first "
                           "request will", e)
            return
        logger.info("LayerKV: host_bounce prepared at start-up in %.0f ms (%d staging buffers "
                    "registered; %d gather kernel launches)", (time.monotonic() - t) * 1e3,
                    len(pool.buffers), launches)

    # ------------------------------------------------------------------ any thread
    def put(self, item: WorkItem) -> None:
        self._queue.put(item)

    def outgoing(self, task: SendTask) -> None:
        """Create the transfer's state before its first item is queued (worker thread)."""
        with self.state.lock:
            if task.transfer_id not in self.state.transfers:
                routes = self._routes_to(task.peer)
                self.state.transfers[task.transfer_id] = Outgoing(
                    transfer_id=task.transfer_id, req_id=task.req_id, routes=routes,
                    state="open" if routes else "acked")

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        for ch in self._channels.values():
            ch.close()

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            item = self._next_item()
            if item is None:
                try:
                    self._land_all()
                except Exception:  # noqa: BLE001 - shutting down: report, do not raise
                    logger.exception("LayerKV sender failed landing a write at shutdown")
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

    def _next_item(self) -> WorkItem | None:
        """The next work item; while none is queued, land the oldest posted write (its report
        frees D's ring slot and lets D scatter it) rather than leave it unreported."""
        while self._posted:
            try:
                return self._queue.get(block=False)
            except queue.Empty:
                pass
            try:
                self._land_oldest()
                self._announce_failures()
            except Exception:  # noqa: BLE001 - never let the thread die silently
                logger.exception("LayerKV sender failed landing a write")
        return self._queue.get()

    def _send_group(self, item: GroupSend) -> None:
        if item.event is not None:
            item.event.synchronize()  # KV of this group is written on the device
        t0 = time.monotonic()
        self._land_finished()
        if self._tracer.enabled and (gpu_s := _device_seconds(item)) is not None:
            self._tracer.event("group_ready", step=item.step, group=item.group, gpu_s=gpu_s)
        self._group_bytes = 0
        try:
            self._write_group(item, t0)
        finally:
            self.link_rate.observe(self._group_bytes, time.monotonic() - t0)
            if item.announces_end:
                self._announce_end(item, t0)

    def _write_group(self, item: GroupSend, t0: float) -> None:
        """Every task's layers of this group, to every decode rank it feeds (``t0``: when the
        group was ready on the device)."""
        self._tracer.event("group_send_start", step=item.step, group=item.group,
                           layers=len(item.layers))
        by_group = self._layers_by_group(item.layers)
        for task in item.tasks:
            out = self._claim(task.transfer_id)
            if out is None:
                continue
            try:
                for endpoint, route in out.routes:
                    channel = self._channel_for(out, endpoint)
                    # one frame per KV cache group: each group has its own block table
                    for group, layers in by_group:
                        src, dst = task.src_blocks[group], task.dst_blocks[group]
                        if not src:
                            continue
                        t = time.monotonic()
                        if route.whole_block and not channel.bounces:
                            n = channel.write_blocks(task.transfer_id, layers, src, dst)
                            self._group_bytes += n
                            self._count(out, endpoint, t, n)
                        else:
                            self._send_slices(out, endpoint, channel, layers, src, dst, route)
                        if group in self._final_only_groups and self._tracer.enabled:
                            self._tracer.event("final_group_sent", transfer_id=task.transfer_id,
                                               step=item.step, kv_group=group,
                                               kind=self._final_only_groups[group],
                                               layers=list(layers), blocks=len(src))
            except TransportError as e:
                self._land_all()  # its writes posted before the failure are reported first
                self._set_state(out, "failed", str(e))
                self._tell_decode_failed(out, str(e))
            finally:
                out.in_use = False
        # with ring writes: every write of the group is posted (``piece_landed`` says when
        # each one is in D's ring)
        self._tracer.event("group_send_end", step=item.step, group=item.group,
                           seconds=time.monotonic() - t0)

    def _announce_end(self, item: GroupSend, t_computed: float) -> None:
        """After the announcing group of a final step (``GroupSend.announces_end``): tell each
        decode rank when the rest is expected, so that an idle D can have vLLM schedule the
        request meanwhile. The estimate is the step's compute rate so far (the device's time,
        where there is one) applied to the layers left, plus this group's send time scaled to
        the layers left (the send may take longer than the compute it follows), plus the link
        time of the ring writes still in flight (posting a group's writes does not land them)."""
        now = time.monotonic()
        layers_left = item.num_layers - item.layers_through
        if layers_left <= 0 or not item.layers_through:
            return
        computed_s = _device_seconds(item)
        if computed_s is None:  # CPU: the hooks run as the layers do
            computed_s = max(0.0, t_computed - item.t_planned)
        per_layer = computed_s / item.layers_through
        compute_left = per_layer * layers_left - (now - t_computed)
        send_last = (now - t_computed) * layers_left / max(1, len(item.layers))
        in_flight = self.link_rate.seconds_for(sum(w.pending.nbytes for w in self._posted))
        eta = max(0.0, compute_left) + send_last + in_flight
        for task in item.tasks:
            if not task.final:
                continue
            out = self._claim(task.transfer_id)
            if out is None:
                continue
            try:
                for endpoint in out.endpoints:
                    self._channel(endpoint).send_nearly_done(task.transfer_id, self._tp_rank,
                                                             eta)
                self._tracer.event("nearly_done_sent", transfer_id=task.transfer_id, eta=eta)
            except TransportError as e:
                self._set_state(out, "failed", str(e))
                self._tell_decode_failed(out, str(e))
            finally:
                out.in_use = False

    def _count(self, out: Outgoing, endpoint: str, t_start: float, nbytes: int) -> None:
        """One transfer operation (a frame, a direct write) to ``endpoint`` is done."""
        self._stats.record_group(nbytes, time.monotonic() - t_start)
        out.frames_to[endpoint] = out.frames_to.get(endpoint, 0) + 1
        out.nbytes_to[endpoint] = out.nbytes_to.get(endpoint, 0) + nbytes
        if not out.t_first:
            out.t_first = t_start

    def _send_slices(self, out: Outgoing, endpoint: str, channel: SendChannel,
                     layers: list[int], src: list[int], dst: list[int],
                     route: tp.Route) -> None:
        """A route's head slice of ``layers`` x blocks (whole blocks through a channel that
        ``bounces``): one transfer per staging buffer's worth (or, with ``tp_staging`` off and
        TP different, one per (layer, block)), each in a staging buffer of its own. Ring writes
        are left in flight (``_posted``, at most ``writes_in_flight``, landed oldest first);
        a write that is complete when posted (bytes on the connection) is counted at once."""
        pool = self._staging_pool()
        per_block = self._blocks.slice_bytes(route.num_heads)
        if self._tp_staging or route.whole_block:
            parts = staging.pieces(len(layers), len(src), per_block, pool.buffer_bytes)
        else:
            parts = [(slice(i, i + 1), slice(j, j + 1))
                     for i in range(len(layers)) for j in range(len(src))]
        for layer_part, block_part in parts:
            while len(self._posted) >= self._writes_in_flight:
                self._land_oldest()
            self._announce_failures()
            if out.terminal:  # a write of it failed to land: the rest of it is not sent
                return
            t = time.monotonic()
            try:
                buf = pool.acquire(len(layers[layer_part]) * len(src[block_part]) * per_block,
                                   self._io_timeout)
            except staging.StagingError as e:
                raise TransportError(f"staging buffer: {e}") from None
            try:
                # D may wait for a slot one of our posted writes holds: land the oldest
                pending = channel.start_slices(out.transfer_id, layers[layer_part],
                                               src[block_part], dst[block_part],
                                               route.src_head, route.dst_head,
                                               route.num_heads, buf, self._land_oldest)
            except BaseException:
                pool.release(buf)
                raise
            write = PostedWrite(out, endpoint, channel, t, buf, pending)
            if pending.handle is None:  # nothing left in flight
                self._land(write)
                continue
            if self._tracer.enabled:  # from the buffer to the write posted
                self._tracer.event("piece_posted", transfer_id=out.transfer_id,
                                   nbytes=pending.nbytes, seconds=time.monotonic() - t,
                                   in_flight=len(self._posted) + 1)
            out.writes_posted += 1
            self._posted.append(write)
            self._land_finished()

    def _land_oldest(self) -> bool:
        """Land the oldest posted write (False: none is in flight)."""
        if not self._posted:
            return False
        write = self._posted.popleft()
        try:
            self._land(write)
        finally:
            write.out.writes_posted -= 1
        return True

    def _announce_failures(self) -> None:
        """Tell D of the transfers a landing write failed, once none of their writes is
        posted: D reads the abort on the connection its writes are reported on, and waits for
        every write into the transfer to end before it closes the transfer. Called only where
        no grant is being waited for (a grant for the transfer would be one more write D
        waits on)."""
        for tid, (out, reason) in list(self._failed_unannounced.items()):
            if not out.writes_posted:
                del self._failed_unannounced[tid]
                self._tell_decode_failed(out, reason)

    def _land_finished(self) -> None:
        """Land the oldest posted writes that are complete already (never waits): D hears of
        each as soon as the sender can tell it."""
        while self._posted and self._posted[0].channel.slices_landed(self._posted[0].pending):
            self._land_oldest()
        self._announce_failures()

    def _land_all(self) -> None:
        while self._land_oldest():
            pass
        self._announce_failures()

    def _land(self, write: PostedWrite) -> None:
        """Finish a posted write, free its staging buffer, count it. A write that failed fails
        its transfer (on D too); the next write of the same connection then fails as well."""
        out, pool = write.out, self._staging_pool()
        t = time.monotonic()
        n = 0
        try:
            n = write.channel.finish_slices(write.pending)
        except TransportError as e:
            if not out.terminal:  # its first failed write (D is told by _announce_failures)
                self._set_state(out, "failed", str(e))
                self._failed_unannounced[out.transfer_id] = (out, str(e))
        finally:
            pool.release(write.buf)
        now = time.monotonic()
        if self._tracer.enabled:  # waiting for the write (what posting the next did not hide)
            self._tracer.event("piece_landed", transfer_id=out.transfer_id, nbytes=n,
                               waited=now - t, seconds=now - write.t_start)
        self._count(out, write.endpoint, write.t_start, n)
        # the link's rate: writes land in order, so this one had the link to itself from its
        # start or from the landing before it, whichever came later
        self.link_rate.observe_write(n, now - max(write.t_start, self._last_landed),
                                     others_in_flight=bool(self._posted))
        self._last_landed = now

    def _staging_pool(self) -> staging.StagingPool:
        if self._staging is None:
            count, nbytes = self._staging_shape
            device = self._blocks.tensors[0].device
            self._staging = staging.StagingPool(count, nbytes, device)
            logger.info("LayerKV: staging buffers for head slices or host_bounce, %d x %d MiB "
                        "on %s", count, nbytes >> 20, device)
        return self._staging

    def _layers_by_group(self, layers: list[int]) -> list[tuple[int, list[int]]]:
        """``layers`` split by KV cache group, in order of first appearance."""
        out: dict[int, list[int]] = {}
        for layer in layers:
            out.setdefault(self._layer_groups[layer], []).append(layer)
        return list(out.items())

    def _finish(self, item: FinishTransfer) -> None:
        self._land_all()  # D counts the transfer's writes against TransferDone's
        out = self._claim(item.task.transfer_id)
        if out is None:
            return
        try:
            for endpoint in out.endpoints:
                self._channel_for(out, endpoint).send_done(out.transfer_id, self._tp_rank,
                                                           out.frames_to.get(endpoint, 0),
                                                           out.nbytes_to.get(endpoint, 0))
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
        self._land_all()  # nothing of the transfer may still read its blocks once aborted
        with self.state.lock:
            out = self.state.transfers.get(item.transfer_id)
        endpoints = (out.endpoints if out is not None
                     else [endpoint for endpoint, _ in self._routes_to(item.peer)])
        if out is None or out.state in ("open", "done_sent"):
            # D may be waiting for this transfer even if nothing was sent yet: tell it
            for endpoint in endpoints:
                try:
                    self._channel(endpoint).send_abort(item.transfer_id, item.reason)
                except TransportError as e:
                    logger.warning("could not tell decode %s that transfer %s was aborted: %s",
                                   endpoint, item.transfer_id, e)
        if out is not None:
            self._set_state(out, "aborted", item.reason, force=True)

    def _tell_decode_failed(self, out: Outgoing, reason: str) -> None:
        """A write failed on this side (a device copy, an injected fault) while the connection
        is still up: abort the transfer on D now, or D would wait for kv_wait_timeout_s. With
        several decode ranks, every one of them is told."""
        for endpoint in out.endpoints:
            channel = self._channels.get(endpoint)
            if channel is None or not channel.alive:
                continue  # connection lost: D fails the transfer itself
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
        link = next(self._link_numbers)
        ch = self._transport.open_channel(
            endpoint, self._hello, self._blocks,
            on_ack=lambda ack, ep=endpoint: self._on_ack(ep, ack),
            on_lost=lambda reason, ep=endpoint, n=link: self._on_lost(ep, n, reason),
            timeout=self._connect_timeout,
            io_timeout=self._io_timeout,
        )
        self._channels[endpoint] = ch
        self._links[endpoint] = link
        return ch

    def _channel_for(self, out: Outgoing, endpoint: str) -> SendChannel:
        """The connection to ``endpoint`` for ``out``'s next message: the one its first went
        on. Raises TransportError when that one was lost (D, which bound the transfer to it,
        has failed the transfer or will)."""
        channel = self._channel(endpoint)
        if out.links.setdefault(endpoint, self._links[endpoint]) != self._links[endpoint]:
            raise TransportError(f"the connection to decode {endpoint} that carried it was lost")
        return channel

    # ------------------------------------------------------------------ ack-reader threads
    def _on_ack(self, endpoint: str, ack: TransferAck) -> None:
        with self.state.lock:
            out = self.state.transfers.get(ack.transfer_id)
            if out is None:
                return
            if ack.ok:
                out.acked.add(endpoint)
                if not out.acked.issuperset(out.endpoints):
                    return  # another decode rank has yet to confirm
        if ack.ok:
            self._set_state(out, "acked", "")
        else:
            self._set_state(out, "failed", f"decode dropped the transfer: {ack.reason}")

    def _on_lost(self, endpoint: str, link: int, reason: str) -> None:
        """Connection ``link`` to ``endpoint`` was lost: the transfers it carried fail."""
        with self.state.lock:
            affected = [o for o in self.state.transfers.values()
                        if o.links.get(endpoint) == link and not o.terminal]
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

    def _routes_to(self, peer: Peer) -> list[tuple[str, tp.Route]]:
        """(endpoint, route) per decode rank of ``peer`` that this rank feeds."""
        routes = self._route_cache.get(peer.tp_size)
        if routes is None:
            p_tp = self._hello.tp_size
            if p_tp == peer.tp_size:
                routes = [tp.Route(d_rank=self._tp_rank, src_head=0, dst_head=0,
                                   num_heads=self._blocks.local_heads, whole_block=True)]
            else:
                routes = tp.routes(self._tp_rank, p_tp, peer.tp_size,
                                   self._hello.compat.total_kv_heads)
            self._route_cache[peer.tp_size] = routes
        return [(peer.data_endpoints[r.d_rank], r) for r in routes]


def _device_seconds(item: GroupSend) -> float | None:
    """The device's time from the step's start to ``item``'s last layer (None: no timing
    events, e.g. on CPU). Both events have completed: the sender waited on ``item.event``."""
    if item.step_start is None or item.event is None:
        return None
    try:
        return item.step_start.elapsed_time(item.event) / 1e3
    except RuntimeError:  # an event made without timing
        return None

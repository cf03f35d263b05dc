"""Both ends of a transport in one process, for the transport tests: a prefill ``Sender`` that
pushes KV from CPU tensors and a decode receiver whose ``RecvTable`` decides what may be
written, with helpers to drive them the way the workers do and to check D's KV memory (filled
with a sentinel first, so any byte written where it must not be shows up). The fixtures that
make them are in conftest.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.tasks import Peer, SendTask
from vllm_layerkv.transport import create_transport
from vllm_layerkv.transport.base import Transport
from vllm_layerkv.wire.protocol import CompatInfo, Hello
from vllm_layerkv.worker.receiver import RecvTable
from vllm_layerkv.worker.sender import (
    FinishTransfer,
    GroupSend,
    Outgoing,
    Sender,
    SenderParts,
    SenderTuning,
)

NUM_LAYERS, NUM_BLOCKS, BLOCK_BYTES = 4, 64, 4096
SENTINEL = 0xA5
UNKNOWN_WAIT_S = 0.3
TIMEOUT = 10.0


def compat(num_layers: int = NUM_LAYERS, block_bytes: int = BLOCK_BYTES, **kw) -> CompatInfo:
    fields = dict(vllm_version="0.32.0", model="tiny-llama", dtype="uint8", kv_layout="HND",
                  block_size=16, num_kv_heads=2, head_size=64, num_layers=num_layers,
                  block_bytes=block_bytes)
    fields.update(kw)
    return CompatInfo(**fields)


def make_caches(fill: int | None, dtype: torch.dtype = torch.uint8, seed: int = 0,
                num_layers: int = NUM_LAYERS, num_blocks: int = NUM_BLOCKS,
                block_bytes: int = BLOCK_BYTES) -> dict[str, torch.Tensor]:
    """vLLM-shaped HND caches [blocks, kv_heads=2, block_size=16, content] of ``block_bytes``."""
    elem = torch.tensor([], dtype=dtype).element_size()
    content = block_bytes // (2 * 16 * elem)
    gen = torch.Generator().manual_seed(seed)
    caches = {}
    for i in range(num_layers):
        t = torch.empty(num_blocks, 2, 16, content, dtype=dtype)
        raw = t.view(torch.uint8)
        if fill is None:
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        else:
            raw.fill_(fill)
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


@dataclass
class DSide:
    table: RecvTable
    transport: Transport
    endpoint: str
    layout: KVLayout
    stats: WorkerStats

    def block(self, layer: int, block: int) -> bytes:
        return bytes(self.layout.host_block_views()[layer][block])

    def drain_until(self, pred: Callable[[set[str], set[str]], bool],
                    timeout: float = TIMEOUT) -> tuple[set[str], set[str]]:
        """Accumulate drain() results until ``pred(finished, failed)`` holds."""
        finished: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + timeout
        while True:
            f, x = self.table.drain()
            assert not (f & finished) and not (x & failed), "reported twice"
            finished |= f
            failed |= x
            if pred(finished, failed):
                return finished, failed
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; finished={finished} failed={failed}")
            self.table.results_ready.wait(0.05)


def transport_config(transport: str, config: LayerKVConfig | None = None
                     ) -> tuple[str, LayerKVConfig]:
    """A test transport id -> (``transport`` setting, config): ``"nixl+bounce"`` is NIXL with
    ``host_bounce`` on (whole blocks through D's receive ring in host memory)."""
    name, _, variant = transport.partition("+")
    config = config or LayerKVConfig()
    if variant == "bounce":
        config = config.replace(host_bounce="on")
    elif variant:
        raise ValueError(f"unknown test transport variant {transport!r}")
    return name, config


def start_d(dtype: torch.dtype = torch.uint8, num_blocks: int = NUM_BLOCKS,
            block_bytes: int = BLOCK_BYTES, info: CompatInfo | None = None,
            unknown_wait_s: float = UNKNOWN_WAIT_S, io_timeout: float = 5.0,
            transport: str = "tcp", early_lead_s: float = 0.0, ring_slots: int = 4,
            config: LayerKVConfig | None = None) -> DSide:
    """``config``: further settings (authentication, listener limits, closed-transfer
    records); ``io_timeout`` and ``ring_slots`` override its values."""
    caches = make_caches(SENTINEL, dtype, num_blocks=num_blocks, block_bytes=block_bytes)
    layout = KVLayout.from_kv_caches(caches, num_blocks)
    stats = WorkerStats()
    base = (config or LayerKVConfig()).replace(io_timeout_s=io_timeout,
                                               recv_ring_slots=ring_slots)
    table = RecvTable(info or compat(block_bytes=block_bytes), tp_rank=0, tp_size=1,
                      unknown_wait_s=unknown_wait_s, stats=stats, early_lead_s=early_lead_s,
                      max_closed=base.max_closed_transfers,
                      closed_ttl_s=base.closed_transfer_ttl_s)
    blocks = HostBlockIO(layout)
    name, config = transport_config(transport, base)
    mover = create_transport(name, blocks, config)
    endpoint = mover.start_receiver("127.0.0.1", 0, table, blocks, io_timeout)
    return DSide(table, mover, endpoint, layout, stats)


@dataclass
class PSide:
    sender: Sender
    layout: KVLayout
    stats: WorkerStats
    engine_id: str

    def block(self, layer: int, block: int) -> bytes:
        return bytes(self.layout.host_block_views()[layer][block])

    def out(self, tid: str) -> Outgoing:
        with self.sender.state.lock:
            return self.sender.state.transfers[tid]

    def wait_state(self, tid: str, states: Sequence[str], timeout: float = TIMEOUT) -> Outgoing:
        deadline = time.monotonic() + timeout
        while True:
            out = self.out(tid)
            if out.state in states:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{tid} is {out.state!r} ({out.reason}), wanted {states}")
            self.sender.state.changed.wait(0.05)
            self.sender.state.changed.clear()


def start_p(transport: str, engine_id: str = "prefill-0", dtype: torch.dtype = torch.uint8,
            seed: int = 1, info: CompatInfo | None = None, tp_size: int = 1,
            num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES,
            config: LayerKVConfig | None = None) -> PSide:
    caches = make_caches(None, dtype, seed=seed, num_blocks=num_blocks, block_bytes=block_bytes)
    layout = KVLayout.from_kv_caches(caches, num_blocks)
    stats = WorkerStats()
    hello = Hello(compat=info or compat(block_bytes=block_bytes), engine_id=engine_id,
                  tp_rank=0, tp_size=tp_size)
    blocks = HostBlockIO(layout)
    name, config = transport_config(transport, config)
    sender = Sender(SenderParts(create_transport(name, blocks, config), blocks, hello,
                                stats=stats, tracer=Tracer("", "p", 0)),
                    SenderTuning(connect_timeout_s=2.0, io_timeout_s=5.0,
                                 staging_bytes=config.staging_buffer_mb << 20,
                                 staging_buffers=config.staging_buffers,
                                 writes_in_flight=config.writes_in_flight))
    return PSide(sender, layout, stats, engine_id)


def PEER(d: DSide) -> Peer:  # noqa: N802
    return Peer(engine_id="decode-0", tp_size=1, data_endpoints=[d.endpoint])


def task(tid: str, d: DSide, src: list[int], dst: list[int], final: bool = True,
         req_id: str | None = None) -> SendTask:
    return SendTask(req_id=req_id or f"req-{tid}", transfer_id=tid,
                    peer=PEER(d),
                    src_blocks=[src], dst_blocks=[dst], final=final, new_tokens=16 * len(src))


def push(p: PSide, tasks: list[SendTask], groups: Sequence[Sequence[int]] = ((0, 1), (2, 3)),
         finish: bool = True, step: int = 1) -> None:
    """What PrefillWorker does for one step: one GroupSend per layer group, then FinishTransfer
    for the tasks that are final."""
    for t in tasks:
        p.sender.outgoing(t)
    for g, layers in enumerate(groups):
        p.sender.put(GroupSend(step=step, group=g, layers=list(layers), tasks=tasks))
    if finish:
        for t in tasks:
            if t.final:
                p.sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))


def assert_copied(p: PSide, d: DSide, pairs: Sequence[tuple[int, int]],
                  layers: Sequence[int] = range(NUM_LAYERS)) -> None:
    """D block dst == P block src for the pairs and layers; every other D byte is the sentinel."""
    written = {(layer, dst) for layer in layers for _, dst in pairs}
    for layer in layers:
        for src, dst in pairs:
            assert d.block(layer, dst) == p.block(layer, src), f"layer {layer} {src}->{dst}"
    assert_sentinel(d, exclude=written)


def assert_sentinel(d: DSide, exclude: set[tuple[int, int]] = frozenset()) -> None:
    views = d.layout.host_block_views()
    for layer, view in enumerate(views):
        for b in range(view.shape[0]):
            if (layer, b) not in exclude:
                assert (view[b] == SENTINEL).all(), f"D layer {layer} block {b} was written"

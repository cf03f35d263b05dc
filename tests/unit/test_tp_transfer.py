"""Prefill TP != decode TP through the real data path: P ranks (each a ``Sender`` over its own
share of the KV heads, as vLLM splits them) push to D ranks (each a ``RecvTable`` and a
transport receiver over its poisoned share) through gather -> transfer -> scatter, and every
element of every D rank is checked against the model's KV split the way D's TP splits it.

Both directions, GQA replication (more ranks than KV heads), chunked sends, every transport
that runs on CPU (TCP, and ``auto`` with the KV in host memory, carry slices as bytes; NIXL and
Mooncake, when named, write them into D's receive ring, which D scatters), receive-ring
back-pressure, and the transfer-operation count with and without staging.

NIXL and Mooncake are optional dependencies that the test set-up installs; as in the
conformance suite, LAYERKV_TEST_TRANSPORTS names the transports to run when one is missing."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from kv_sides import SENTINEL, TIMEOUT, compat

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv import tp
from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.tasks import Peer, SendTask
from vllm_layerkv.transport import create_transport
from vllm_layerkv.wire.protocol import Hello
from vllm_layerkv.worker.receiver import RecvTable
from vllm_layerkv.worker.sender import (
    FinishTransfer,
    GroupSend,
    Sender,
    SenderParts,
    SenderTuning,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 32, 16, 8  # float32: 512 B per head per block
GROUPS = ((0, 1), (2, 3))
TRANSPORTS = os.environ.get("LAYERKV_TEST_TRANSPORTS", "tcp,nixl,mooncake").split(",")
RING_ENGINES = [t for t in ("nixl", "mooncake") if t in TRANSPORTS]


def global_kv(heads: int, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The model's KV per layer: [blocks, heads, block_size, head_dim] (HND), float32 or, for
    an fp8 cache, the bytes vLLM stores it as (uint8)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return [torch.randint(0, 256, (BLOCKS, heads, BLOCK_SIZE, HEAD_DIM), generator=gen,
                              dtype=torch.uint8) for _ in range(LAYERS)]
    return [torch.randn(BLOCKS, heads, BLOCK_SIZE, HEAD_DIM, generator=gen, dtype=dtype)
            for _ in range(LAYERS)]


def rank_caches(kv: list[torch.Tensor], rank: int, tp_size: int, heads: int,
                fill: float | None) -> dict[str, torch.Tensor]:
    first, count = tp.rank_heads(rank, tp_size, heads)
    out = {}
    for i, layer in enumerate(kv):
        t = layer[:, first:first + count].clone()
        if fill is not None:
            t.view(torch.uint8).fill_(SENTINEL)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def rank_compat(tp_size: int, heads: int, dtype: torch.dtype = torch.float32):
    local = max(1, heads // tp_size)
    return compat(num_kv_heads=local,
                  block_bytes=local * BLOCK_SIZE * HEAD_DIM * dtype.itemsize,
                  dtype=str(dtype).removeprefix("torch."), total_kv_heads=heads)


@dataclass
class DRank:
    table: RecvTable
    transport: object
    endpoint: str
    caches: dict[str, torch.Tensor]


@dataclass
class PRank:
    sender: Sender
    stats: WorkerStats


class Cluster:
    """``p_tp`` prefill ranks and ``d_tp`` decode ranks of one model with ``heads`` KV heads."""

    def __init__(self, transport: str, heads: int, p_tp: int, d_tp: int,
                 tp_staging: bool = True, staging_bytes: int = 1 << 20, ring_slots: int = 4,
                 dtype: torch.dtype = torch.float32):
        self.heads, self.p_tp, self.d_tp = heads, p_tp, d_tp
        self.kv = global_kv(heads, seed=heads * 100 + p_tp * 10 + d_tp, dtype=dtype)
        config = LayerKVConfig(io_timeout_s=5.0, staging_buffer_mb=max(1, staging_bytes >> 20),
                               recv_ring_slots=ring_slots)
        self.d: list[DRank] = []
        for r in range(d_tp):
            caches = rank_caches(self.kv, r, d_tp, heads, fill=SENTINEL)
            layout = KVLayout.from_kv_caches(caches, BLOCKS)
            blocks = HostBlockIO(layout, local_heads=max(1, heads // d_tp))
            table = RecvTable(rank_compat(d_tp, heads, dtype), tp_rank=r, tp_size=d_tp,
                              unknown_wait_s=0.3, stats=WorkerStats())
            mover = create_transport(transport, blocks, config)
            endpoint = mover.start_receiver("127.0.0.1", 0, table, blocks, 5.0)
            self.d.append(DRank(table, mover, endpoint, caches))
        self.p: list[PRank] = []
        for r in range(p_tp):
            layout = KVLayout.from_kv_caches(rank_caches(self.kv, r, p_tp, heads, None), BLOCKS)
            blocks = HostBlockIO(layout, local_heads=max(1, heads // p_tp))
            hello = Hello(compat=rank_compat(p_tp, heads, dtype), engine_id="prefill", tp_rank=r,
                          tp_size=p_tp)
            stats = WorkerStats()
            sender = Sender(SenderParts(create_transport(transport, blocks, config), blocks,
                                        hello, stats=stats, tracer=Tracer("", "p", r)),
                            SenderTuning(connect_timeout_s=2.0, io_timeout_s=5.0,
                                         tp_staging=tp_staging, staging_bytes=staging_bytes,
                                         staging_buffers=2))
            self.p.append(PRank(sender, stats))
        self.peer = Peer(engine_id="decode", tp_size=d_tp,
                         data_endpoints=[d.endpoint for d in self.d])

    def expect(self, tid: str, dst: list[int]) -> None:
        from vllm_layerkv.tasks import RecvTask

        for d in self.d:
            d.table.expect(RecvTask(req_id=f"req-{tid}", transfer_id=tid, block_ids=dst))

    def send(self, tid: str, src: list[int], dst: list[int], final: bool) -> None:
        """One prefill step on every P rank: the layer groups, then TransferDone if final."""
        for p in self.p:
            task = SendTask(req_id=f"req-{tid}", transfer_id=tid, peer=self.peer,
                            src_blocks=[src], dst_blocks=[dst], final=final,
                            new_tokens=BLOCK_SIZE * len(src))
            p.sender.outgoing(task)
            for g, layers in enumerate(GROUPS):
                p.sender.put(GroupSend(step=1, group=g, layers=list(layers), tasks=[task]))
            if final:
                p.sender.put(FinishTransfer(task, t_compute_end=time.monotonic()))

    def wait_done(self, tid: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        for d in self.d:
            finished: set[str] = set()
            while f"req-{tid}" not in finished:
                f, failed = d.table.drain()
                assert not failed, f"decode rank failed {failed}"
                finished |= f
                assert time.monotonic() < deadline, "transfer did not complete"
                d.table.results_ready.wait(0.05)
        for p in self.p:
            while True:
                with p.sender.state.lock:
                    out = p.sender.state.transfers[tid]
                    if out.terminal:
                        break
                assert time.monotonic() < deadline, f"P never terminal ({out.state})"
                time.sleep(0.01)
            assert out.state == "acked", out.reason

    def check(self, pairs: list[tuple[int, int]]) -> None:
        """Each D rank holds, in the written blocks, exactly its heads of P's source blocks;
        every other byte is still the sentinel."""
        written = {dst for _, dst in pairs}
        for r, d in enumerate(self.d):
            first, count = tp.rank_heads(r, self.d_tp, self.heads)
            for i, layer in enumerate(self.kv):
                got = d.caches[f"model.layers.{i}.self_attn.attn"]
                for src, dst in pairs:
                    assert torch.equal(got[dst], layer[src, first:first + count]), \
                        f"D rank {r} layer {i} block {src}->{dst}"
                raw = got.view(torch.uint8)
                for b in range(BLOCKS):
                    if b not in written:
                        assert (raw[b] == SENTINEL).all(), f"D rank {r} block {b} written"

    def ops(self) -> int:
        """Transfer operations (frames / direct writes) all P ranks issued."""
        return sum(p.stats.take().data["groups_sent"] for p in self.p)

    def ring_writers(self) -> int:
        """P's open channels that write head slices into a decode receive ring."""
        return sum(getattr(getattr(ch, "_writer", None), "ring_slots", 0) > 0
                   for p in self.p for ch in p.sender._channels.values())

    def close(self) -> None:
        for p in self.p:
            p.sender.shutdown()
        for d in self.d:
            d.transport.shutdown()


LAYOUTS = [  # (heads, p_tp, d_tp)
    (2, 2, 1),  # P wider: D rank 0 gathers from two P ranks
    (2, 1, 2),  # D wider: one P rank feeds two D ranks
    (4, 4, 2),
    (4, 2, 4),
    (2, 4, 1),  # GQA replication on P: ranks (0,1) and (2,3) hold the same head
    (2, 1, 4),  # replication on D: each head goes to two D ranks
    (1, 2, 2),  # equal TP, one head replicated: whole blocks
]


@pytest.fixture
def cluster():
    made: list[Cluster] = []

    def make(*args, **kw) -> Cluster:
        c = Cluster(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("heads, p_tp, d_tp", LAYOUTS)
def test_slices_land_in_every_decode_rank(cluster, transport, heads, p_tp, d_tp) -> None:
    c = cluster(transport, heads, p_tp, d_tp)
    src, dst = [3, 4, 5, 9, 20], [7, 8, 9, 1, 30]
    c.expect("t1", dst)
    c.send("t1", src[:3], dst[:3], final=False)  # chunk 1
    c.send("t1", src[3:], dst[3:], final=True)   # chunk 2
    c.wait_done("t1")
    c.check(list(zip(src, dst)))
    if transport != "tcp":  # the engine wrote the slices (equal TP: whole blocks, no ring)
        sliced = p_tp != d_tp
        assert (c.ring_writers() > 0) == sliced
        assert all(d.transport.receiver._ring is not None for d in c.d) == sliced


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("heads, p_tp, d_tp", [(2, 2, 1), (2, 1, 2)])
def test_one_byte_values_slice_like_any_other(cluster, transport, heads, p_tp, d_tp) -> None:
    """An fp8 cache: vLLM stores it as uint8, so a head's slice of a block is a quarter of
    float32's bytes. Every slice must still land whole, and nothing else move."""
    c = cluster(transport, heads, p_tp, d_tp, dtype=torch.uint8)
    src, dst = [3, 4, 5, 9, 20], [7, 8, 9, 1, 30]
    c.expect("t1", dst)
    c.send("t1", src[:3], dst[:3], final=False)
    c.send("t1", src[3:], dst[3:], final=True)
    c.wait_done("t1")
    c.check(list(zip(src, dst)))


@pytest.mark.parametrize("transport", RING_ENGINES)
def test_a_forced_network_engine_writes_slices_into_the_receive_ring(cluster, transport
                                                                     ) -> None:
    """transport=nixl / mooncake with different TP: every channel writes into D's ring (no
    byte fallback is allowed), one transfer per (group, route), and the data is exact."""
    c = cluster(transport, 4, 2, 1)
    src, dst = list(range(12)), list(range(31, 19, -1))
    c.expect("t1", dst)
    c.send("t1", src, dst, final=True)
    c.wait_done("t1")
    c.check(list(zip(src, dst)))
    assert c.ring_writers() == 2  # both P ranks, to the one D rank
    assert c.ops() == 2 * len(GROUPS)


def test_auto_sends_host_memory_slices_as_bytes(cluster) -> None:
    """On CPU, auto picks NIXL (else Mooncake) when installed for whole blocks, but with the KV
    in host memory D offers no ring, so head slices go as bytes on the data connection (the
    engine ring is used when the engine is named, or with the KV on a GPU). Exact either way."""
    c = cluster("auto", 4, 2, 4)
    src, dst = list(range(10)), list(range(20, 30))
    c.expect("t1", dst)
    c.send("t1", src, dst, final=True)
    c.wait_done("t1")
    c.check(list(zip(src, dst)))
    assert c.ring_writers() == 0
    assert all(d.transport.receiver._ring is None for d in c.d)


@pytest.mark.parametrize("transport", RING_ENGINES)
def test_a_full_receive_ring_delays_grants_and_loses_nothing(cluster, transport) -> None:
    """One ring slot on D, two P ranks and many staging-buffer-sized pieces: grants wait for
    the slot to be scattered and freed (back-pressure), and every element still lands."""
    # 4 heads, P TP2 -> D TP1: 1 KiB per block slice; an 8 KiB buffer holds 8 blocks, so each
    # group (2 layers x 32 blocks) goes as 8 writes per P rank, all through one slot
    c = cluster(transport, 4, 2, 1, staging_bytes=8 << 10, ring_slots=1)
    # the ring is made when the first sender connects; make it now and hold its one slot for
    # a moment, so that the first grant has to wait for it whatever the threads' timing
    d_transport = c.d[0].transport
    ring = d_transport.receiver._ring_for(SimpleNamespace(tensors=[torch.empty(0)]),
                                          d_transport._planes[0], tp_differs=True)
    held = ring.acquire(1, 1.0)
    threading.Timer(0.3, ring.release, [held]).start()
    src, dst = list(range(BLOCKS)), list(range(BLOCKS))[::-1]
    c.expect("t", dst)
    c.send("t", src, dst, final=True)
    c.wait_done("t")
    c.check(list(zip(src, dst)))
    assert c.ops() == 2 * len(GROUPS) * 8
    assert c.d[0].transport.receiver._ring is ring and ring.slots == 1 and ring.waits > 0


@pytest.mark.parametrize("transport", RING_ENGINES)
def test_a_ring_the_engine_cannot_register_fails_a_forced_engine_saying_what_to_use(
        cluster, transport, monkeypatch, caplog) -> None:
    """D's engine refuses to register the receive ring: D says why in its log and offers its
    export without a ring; a forced engine may not fall back to bytes, so the transfer fails
    at once, saying what to use, and D is told rather than left waiting."""
    from vllm_layerkv.transport.mooncake import MooncakePlane
    from vllm_layerkv.transport.nixl import NixlPlane

    def refuse(self, t) -> None:
        raise RuntimeError("registration refused (test)")

    for cls in (NixlPlane, MooncakePlane):
        monkeypatch.setattr(cls, "register", refuse)
    c = cluster(transport, 4, 2, 1)
    c.expect("t1", [1, 2])
    c.send("t1", [1, 2], [1, 2], final=True)
    deadline = time.monotonic() + TIMEOUT
    while not all(p.sender.state.transfers["t1"].terminal for p in c.p):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for p in c.p:
        out = p.sender.state.transfers["t1"]
        assert out.state == "failed" and "use transport=auto or tcp" in out.reason, out.reason
        assert "offered no receive ring" in out.reason, out.reason
    _, failed = c.d[0].table.drain()
    assert failed == {"req-t1"}  # D was told at once, not left waiting
    c.check([])
    assert "cannot register the receive ring (registration refused (test))" in caplog.text


def test_staging_sends_one_transfer_per_group_and_rank(cluster) -> None:
    """P TP2 -> D TP1, 16 blocks, 2 groups of 2 layers: with staging each P rank sends one
    transfer per group; without, one per (layer, block) slice."""
    src = list(range(16))
    dst = list(range(16, 32))
    staged = cluster("tcp", 2, 2, 1)
    staged.expect("a", dst)
    staged.send("a", src, dst, final=True)
    staged.wait_done("a")
    staged.check(list(zip(src, dst)))
    sliced = cluster("tcp", 2, 2, 1, tp_staging=False)
    sliced.expect("b", dst)
    sliced.send("b", src, dst, final=True)
    sliced.wait_done("b")
    sliced.check(list(zip(src, dst)))
    with_staging, without = staged.ops(), sliced.ops()
    assert with_staging == 2 * len(GROUPS)
    assert without == 2 * LAYERS * len(src)
    assert without >= 10 * with_staging


def test_groups_larger_than_a_staging_buffer_are_split(cluster) -> None:
    from vllm_layerkv.kv.staging import StagingError, pieces

    assert pieces(2, 32, 1024, 1 << 20) == [(slice(0, 2), slice(0, 32))]
    assert pieces(4, 32, 1024, 64 << 10) == [(slice(0, 2), slice(0, 32)),
                                             (slice(2, 4), slice(0, 32))]
    assert pieces(2, 10, 1024, 4096) == [
        (slice(0, 1), slice(0, 4)), (slice(0, 1), slice(4, 8)), (slice(0, 1), slice(8, 10)),
        (slice(1, 2), slice(0, 4)), (slice(1, 2), slice(4, 8)), (slice(1, 2), slice(8, 10))]
    with pytest.raises(StagingError, match="staging_buffer_mb"):
        pieces(1, 1, 2048, 1024)
    # 4 heads, P TP1 -> D TP4: 512 B per block slice; a 4 KiB buffer holds 8 blocks, so each
    # group (2 layers x 32 blocks) goes as 8 transfers per decode rank
    c = cluster("tcp", 4, 1, 4, staging_bytes=4096)
    src, dst = list(range(BLOCKS)), list(range(BLOCKS))
    c.expect("t", dst)
    c.send("t", src, dst, final=True)
    c.wait_done("t")
    c.check(list(zip(src, dst)))
    assert c.ops() == 4 * len(GROUPS) * 8


def test_a_prefill_rank_that_cannot_map_is_refused_at_the_data_handshake(cluster) -> None:
    c = cluster("tcp", 4, 1, 2)
    bad = Hello(compat=rank_compat(3, 4), engine_id="p3", tp_rank=0, tp_size=3)
    # the refusal names what differs; why ("does not divide"), with the values, is in D's log
    assert "tensor_parallel_size" in c.d[0].table.check_hello(bad)
    good = Hello(compat=rank_compat(4, 4), engine_id="p4", tp_rank=0, tp_size=4)
    assert c.d[0].table.check_hello(good) is None


"""Head-slice gather -> transfer -> scatter (staging.py) on random data against a reference,
for every TP layout the mapping produces (P TP > D TP, P TP < D TP, GQA replication), with the
decode caches poisoned first so every element is checked. CPU here; the same functions run on
the GPU's KV tensors (tests/gpu/)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_layerkv.kv import tp
from vllm_layerkv.kv.staging import (
    MAX_COPY_RUNS,
    RecvRing,
    StagingError,
    StagingPool,
    copy_block_runs,
    gather,
    scatter,
)

LAYERS, BLOCKS, BLOCK_TOKENS, HEAD_DIM, ELEM = 3, 12, 4, 8, 2  # bf16-sized elements
POISON = 0xEE


def rank_caches(heads: int, local: int, first: int, global_kv: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """A rank's per-layer ``[blocks, block_bytes]`` uint8 caches holding heads
    ``[first, first+local)`` of the global cache (``[blocks, heads, tokens*dim*elem]``)."""
    return [g[:, first:first + local].contiguous().view(BLOCKS, -1) for g in global_kv]


@pytest.mark.parametrize("heads, p_tp, d_tp", [
    (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (8, 8, 1), (2, 4, 1), (2, 1, 4), (2, 4, 8),
    (4, 8, 2)])
def test_gather_send_scatter_matches_the_reference(heads: int, p_tp: int, d_tp: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + p_tp * 10 + d_tp)
    head_bytes = BLOCK_TOKENS * HEAD_DIM * ELEM
    global_kv = [torch.randint(0, 256, (BLOCKS, heads, head_bytes), dtype=torch.uint8,
                               generator=gen) for _ in range(LAYERS)]
    p_caches = []
    for p in range(p_tp):
        first, count = tp.rank_heads(p, p_tp, heads)
        p_caches.append((count, rank_caches(heads, count, first, global_kv)))
    d_caches = []
    for d in range(d_tp):
        first, count = tp.rank_heads(d, d_tp, heads)
        d_caches.append((first, count, [torch.full((BLOCKS, count * head_bytes), POISON,
                                                   dtype=torch.uint8) for _ in range(LAYERS)]))
    src_blocks, dst_blocks = [0, 1, 2, 7, 9], [11, 3, 4, 5, 0]
    groups = [[0, 1], [2]]
    pool = StagingPool(2, 1 << 20)
    transfers = 0
    for p, (p_local, caches) in enumerate(p_caches):
        for route in tp.routes(p, p_tp, d_tp, heads):
            _, d_local, d_kv = d_caches[route.d_rank]
            for layers in groups:
                buf = pool.acquire(1, timeout=1.0)
                try:
                    payload = gather(caches, layers, src_blocks, route.src_head,
                                     route.num_heads, p_local, buf)
                    wire = payload.clone()  # what crosses the transport
                finally:
                    pool.release(buf)
                scatter(wire, d_kv, layers, dst_blocks, route.dst_head, route.num_heads,
                        d_local)
                transfers += 1
    # one transfer per (route, layer group), however many blocks and heads it carries
    assert transfers == sum(len(tp.routes(p, p_tp, d_tp, heads)) for p in range(p_tp)) * 2
    for d, (first, count, d_kv) in enumerate(d_caches):
        for layer in range(LAYERS):
            got = d_kv[layer].view(BLOCKS, count, head_bytes)
            for b in range(BLOCKS):
                if b in dst_blocks:
                    want = global_kv[layer][src_blocks[dst_blocks.index(b)], first:first + count]
                    assert torch.equal(got[b], want), (d, layer, b)
                else:
                    assert (got[b] == POISON).all(), f"D rank {d} layer {layer} block {b}"


def test_payload_that_does_not_fit_is_refused() -> None:
    caches = [torch.zeros(4, 64, dtype=torch.uint8)]
    with pytest.raises(StagingError, match="do not fit"):
        gather(caches, [0], [0, 1, 2], 0, 2, 2, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(StagingError, match="not 1 layers x 1 blocks"):
        scatter(torch.zeros(10, dtype=torch.uint8), caches, [0], [0], 0, 1, 2)
    with pytest.raises(StagingError, match="does not split"):
        gather(caches, [0], [0], 0, 1, 3, torch.empty(100, dtype=torch.uint8))


def test_pool_is_bounded_and_waits_for_a_release() -> None:
    pool = StagingPool(1, 1024)
    with pytest.raises(StagingError, match="exceed the staging buffer size"):
        pool.acquire(2048, timeout=0.1)
    held = pool.acquire(10, timeout=0.1)
    with pytest.raises(StagingError, match="no staging buffer was released"):
        pool.acquire(10, timeout=0.1)
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(10, timeout=5.0)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: the held buffer is not handed out twice
    pool.release(held)
    waiter.join(5.0)
    assert got and got[0].data_ptr() == held.data_ptr()  # reused, not reallocated
    assert pool.waits == 2 and pool.free == 0


def test_receive_ring_grants_each_slot_once_and_holds_back_until_one_is_freed() -> None:
    """D's receive ring: a slot is not granted again before it was scattered and freed; with
    every slot busy the grant waits (back-pressure), bounded; oversize writes are refused."""
    ring = RecvRing(2, 1024, "cpu")
    with pytest.raises(StagingError, match="no larger than decode's"):
        ring.acquire(2048, timeout=0.1)
    a, b = ring.acquire(1024, timeout=0.1), ring.acquire(10, timeout=0.1)
    assert {a, b} == {0, 1}
    assert ring.view(a, 16).data_ptr() == ring.tensor[a].data_ptr()
    with pytest.raises(StagingError, match="no receive-ring slot was freed"):
        ring.acquire(10, timeout=0.1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(10, timeout=5.0)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # back-pressure: still waiting, nothing handed out twice
    ring.release(b)
    waiter.join(5.0)
    assert got == [b] and ring.waits == 2


def test_a_full_ring_refuses_the_write_and_fails_the_transfer_on_decode() -> None:
    """D's TcpReceiver: a head-slice write that finds no free slot in time is refused and
    its transfer aborted with the reason (P then fails it), instead of overwriting a slot;
    while it waits the connection's thread is not blocked (it returns at once), and once a
    slot is free the next waiting write gets it. A write that cannot fit a slot at all is
    refused at once."""
    import socket
    from collections import deque

    from vllm_layerkv.transport.base import Source
    from vllm_layerkv.transport.tcp_receiver import TcpReceiver
    from vllm_layerkv.wire import framing
    from vllm_layerkv.wire.protocol import DirectWrite, WriteGrant

    class Sink:
        def __init__(self) -> None:
            self.ended: list[str] = []
            self.aborted: list[tuple[str, str]] = []

        def end_write(self, transfer_id: str, nbytes: int) -> None:
            self.ended.append(transfer_id)

        def on_abort(self, transfer_id: str, reason: str, source: Source | None = None
                     ) -> None:
            self.aborted.append((transfer_id, reason))

    def write(seq: int, nbytes: int = 64) -> DirectWrite:
        return DirectWrite(transfer_id=f"t{seq}", seq=seq, layers=[0], dst_blocks=[3],
                           first_head=0, num_heads=1, nbytes=nbytes)

    ring = RecvRing(1, 1024, "cpu")
    held = ring.acquire(10, timeout=0.1)
    receiver = TcpReceiver()
    receiver._ring_wait_s = 0.1
    sink = Sink()
    source = Source("p", 0, 1, 1)
    d_end, p_end = socket.socketpair()
    granted: dict = {}
    waiting = deque([(write(1), ring, time.monotonic() + 0.1)])
    t0 = time.monotonic()
    receiver._grant_waiting(d_end, waiting, granted, sink, source)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.05 and len(waiting) == 1 and not sink.ended
    time.sleep(0.15)
    receiver._grant_waiting(d_end, waiting, granted, sink, source)  # type: ignore[arg-type]
    assert not waiting and not granted
    assert framing.recv_message(p_end) == WriteGrant(seq=1, ok=False, slot=-1)
    assert sink.ended == ["t1"]
    assert sink.aborted and "head-slice write refused: no receive-ring slot" in sink.aborted[0][1]
    ring.release(held)
    waiting.append((write(2), ring, time.monotonic() + 0.1))
    receiver._grant_waiting(d_end, waiting, granted, sink, source)  # type: ignore[arg-type]
    assert framing.recv_message(p_end) == WriteGrant(seq=2, ok=True, slot=held)
    assert granted[2][1:] == (held, ring)
    assert not receiver._fits_ring(write(3, nbytes=2048), ring, sink, source)  # type: ignore
    assert "no larger than decode's" in sink.aborted[-1][1] and sink.ended[-1] == "t3"
    d_end.close()
    p_end.close()


@pytest.mark.parametrize("blocks", [
    list(range(4, 20)),                       # one run
    [*range(3), *range(9, 14), 30, 31],    # three runs
    [2 * i for i in range(MAX_COPY_RUNS)],    # as many runs as are copied run by run
])
def test_whole_blocks_copied_run_by_run_match_the_gather(blocks: list[int]) -> None:
    kv = [torch.randint(0, 256, (32, 96), dtype=torch.uint8) for _ in range(4)]
    layers = [3, 0, 2]
    want = gather(kv, layers, blocks, 0, 4, 4, torch.empty(len(layers) * len(blocks) * 96,
                                                            dtype=torch.uint8))
    out = torch.zeros(len(layers) * len(blocks) * 96 + 7, dtype=torch.uint8)
    assert copy_block_runs(kv, layers, blocks, out)
    assert torch.equal(out[:want.numel()], want) and not out[want.numel():].any()


def test_blocks_in_too_many_runs_are_left_to_the_gather() -> None:
    kv = [torch.randint(0, 256, (64, 32), dtype=torch.uint8) for _ in range(2)]
    blocks = [2 * i for i in range(MAX_COPY_RUNS + 1)]
    out = torch.zeros(2 * len(blocks) * 32, dtype=torch.uint8)
    assert not copy_block_runs(kv, [0, 1], blocks, out)
    assert not out.any()  # nothing copied

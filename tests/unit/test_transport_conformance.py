"""What every transport must do, run against each one: ``tcp`` (bytes over LayerKV's
socket), ``nixl`` (NIXL WRITEs over UCX) and ``mooncake`` (Mooncake TransferEngine over tcp),
and both engines again with ``host_bounce`` on (``+bounce``: every layer group through D's
receive ring in host memory), all on CPU memory in this process. The same prefill ``Sender``
pushes KV into a decode receiver whose ``RecvTable`` decides what may be written; every test
checks the bytes in D's KV memory (pre-filled with a sentinel, so a stray write shows up).

Covered: byte exactness and acks, block lists of every shape (tiny, scattered, large),
ordering across chunks, interleaved and concurrent transfers, refusals, aborts and failures on
either side, and early release (``TransferNearlyDone``: D reports the request before the last
group lands, then waits for it; a failure after that becomes a load error of the step that runs
the request). CUDA IPC runs the same grant protocol; it is tested on GPUs (tests/gpu/) and with
a host double (test_transport_direct.py).

NIXL and Mooncake are optional dependencies (``vllm-layerkv[nixl]``, ``[mooncake-cpu]``); the
test set-up installs both, so a missing one is an error here unless LAYERKV_TEST_TRANSPORTS
names the transports to run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
import torch
from kv_sides import (
    BLOCK_BYTES,
    DSide,
    NUM_BLOCKS,
    NUM_LAYERS,
    PEER,
    SENTINEL,
    TIMEOUT,
    UNKNOWN_WAIT_S,
    PSide,
    assert_copied,
    assert_sentinel,
    push,
    task,
    transport_config,
)

from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv.blockio import block_runs
from vllm_layerkv.tasks import Peer, RecvTask, SendTask
from vllm_layerkv.testing import faults
from vllm_layerkv.transport import tcp_channel
from vllm_layerkv.transport.direct import AddressedPeer, DirectWriteFailed, paired_runs
from vllm_layerkv.transport.nixl import MAX_COALESCED_RUNS
from vllm_layerkv.worker.sender import AbortTransfer, FinishTransfer, GroupSend, Outgoing

TRANSPORTS = os.environ.get("LAYERKV_TEST_TRANSPORTS",
                            "tcp,nixl,mooncake,nixl+bounce,mooncake+bounce").split(",")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


# ------------------------------------------------------------------------------ happy paths


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_transfer_is_byte_exact_and_acked(d_side, p_side, dtype) -> None:
    d, p = d_side(dtype=dtype), p_side(dtype=dtype)
    src, dst = list(range(0, 20)), list(range(30, 50))
    d.table.expect(RecvTask("req-a", "tid-a", dst))
    push(p, [task("tid-a", d, src, dst, req_id="req-a")])

    out = p.wait_state("tid-a", ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert out.frames == 2
    assert out.nbytes == NUM_LAYERS * len(src) * BLOCK_BYTES
    finished, failed = d.drain_until(lambda f, x: bool(f or x))
    assert (finished, failed) == ({"req-a"}, set())
    assert d.table.drain() == (set(), set())  # reported exactly once
    assert d.table.pending() == 0
    assert_copied(p, d, list(zip(src, dst)))
    # closing a transfer that already completed changes nothing (D's scheduler may race it)
    d.table.close("tid-a", failed=True, reason="late")
    assert d.table.drain() == (set(), set())

    d_stats = d.stats.take().data
    assert d_stats["bytes_received"] == out.nbytes and d_stats["transfers_received"] == 1
    # the ack can overtake the sender thread's own bookkeeping of TransferDone: collect
    p_stats = p.stats.take().data
    deadline = time.monotonic() + TIMEOUT
    while p_stats["transfers_sent"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        more = p.stats.take()
        if more is not None:
            p_stats = more.aggregate(type(more)(data=p_stats)).data
    assert p_stats["bytes_sent"] == out.nbytes and p_stats["groups_sent"] == 2
    assert p_stats["transfers_sent"] == 1 and p_stats["transfers_failed"] == 0


def test_non_contiguous_block_lists(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    src = [3, 4, 5, 9, 10, 20, 2, 63]
    dst = [40, 41, 7, 8, 9, 0, 62, 1]
    assert len(list(block_runs(src))) == 5 and len(list(block_runs(dst))) == 5
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")], groups=[(0,), (1,), (2,), (3,)])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, list(zip(src, dst)))


def test_block_lists_counting_down_on_both_sides(d_side, p_side) -> None:
    """A long-running engine reuses a freed request's blocks last first (vLLM frees them in
    that order): such pairs are copied as spans, and every block lands where it is listed."""
    d, p = d_side(), p_side()
    src = [*range(30, 19, -1), 5, 6]
    dst = [*range(50, 39, -1), 1, 2]
    assert paired_runs(src, dst) == [(20, 40, 11), (5, 1, 2)]
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, list(zip(src, dst)))
    assert_sentinel(d, exclude={(layer, b) for layer in range(NUM_LAYERS) for b in dst})


def test_transfer_may_cover_only_some_allocated_blocks(d_side, p_side) -> None:
    """D allocated blocks for the whole prompt; P sends only part (e.g. D had a prefix hit)."""
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [10, 11, 12, 13]))
    push(p, [task("t", d, [0, 1], [12, 13], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, [(0, 12), (1, 13)])


def test_chunked_streaming_later_copy_of_a_partial_block_wins(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    dst = [20, 21, 22]
    d.table.expect(RecvTask("r", "t", dst))
    # chunk 1: blocks 0 and 1 (block 1 only partly filled at this point)
    push(p, [task("t", d, [0, 1], [20, 21], final=False, req_id="r")], step=1)
    deadline = time.monotonic() + TIMEOUT
    while p.out("t").frames < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert d.table.drain() == (set(), set())  # not complete before TransferDone
    while d.block(NUM_LAYERS - 1, 21) != p.block(NUM_LAYERS - 1, 1):  # chunk 1 landed on D
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert d.block(0, 21) == p.block(0, 1)
    # the next chunk fills block 1 further (new bytes) and adds block 2
    for t in p.layout.tensors:
        t.view(torch.uint8)[1].add_(1)
    push(p, [task("t", d, [1, 2], [21, 22], final=True, req_id="r")], step=2)
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "acked" and out.frames == 4
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, [(0, 20), (1, 21), (2, 22)])


def test_interleaved_transfers_on_one_connection(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    plan = {  # tid: (src, dst)
        "t0": ([0, 1, 2], [10, 11, 12]),
        "t1": ([5, 7], [3, 1]),
        "t2": ([30, 31, 32, 33], [50, 51, 52, 53]),
    }
    for tid, (_, dst) in plan.items():
        d.table.expect(RecvTask("r" + tid, tid, dst))
    tasks = [task(tid, d, src, dst, req_id="r" + tid) for tid, (src, dst) in plan.items()]
    # every GroupSend carries all three tasks: their frames interleave layer group by group
    push(p, tasks, groups=[(0,), (1, 2), (3,)])
    for tid in plan:
        assert p.wait_state(tid, ["acked", "failed"]).state == "acked"
        assert p.out(tid).frames == 3
    assert d.drain_until(lambda f, x: len(f) == 3) == ({"rt0", "rt1", "rt2"}, set())
    assert_copied(p, d, [pair for src, dst in plan.values() for pair in zip(src, dst)])


def test_two_prefill_engines_push_concurrently(d_side, p_side) -> None:
    d = d_side()
    p1, p2 = p_side("prefill-1", seed=11), p_side("prefill-2", seed=22)
    d.table.expect(RecvTask("r1", "t1", list(range(0, 16))))
    d.table.expect(RecvTask("r2", "t2", list(range(32, 48))))
    threads = [
        threading.Thread(target=push, args=(p1, [task("t1", d, list(range(16)),
                                                      list(range(16)), req_id="r1")])),
        threading.Thread(target=push, args=(p2, [task("t2", d, list(range(16, 32)),
                                                      list(range(32, 48)), req_id="r2")])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p1.wait_state("t1", ["acked", "failed"]).state == "acked"
    assert p2.wait_state("t2", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: len(f) == 2) == ({"r1", "r2"}, set())
    for layer in range(NUM_LAYERS):
        for i in range(16):
            assert d.block(layer, i) == p1.block(layer, i)
            assert d.block(layer, 32 + i) == p2.block(layer, 16 + i)
    assert_sentinel(d, exclude={(layer, b) for layer in range(NUM_LAYERS)
                                for b in [*range(16), *range(32, 48)]})


def test_frames_wait_for_a_transfer_the_worker_learns_about_late(d_side, p_side) -> None:
    """P can be faster than D's scheduler -> worker metadata: frames wait (unknown_wait_s)."""
    d, p = d_side(unknown_wait_s=5.0), p_side()
    push(p, [task("t", d, [0, 1], [5, 6], req_id="r")])
    time.sleep(0.2)  # the first frame is now waiting inside the receiver
    d.table.expect(RecvTask("r", "t", [5, 6]))
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, [(0, 5), (1, 6)])


def test_frame_naming_a_foreign_block_fails_the_transfer_and_writes_nothing(d_side, p_side):
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [10, 11, 12]))
    # block 13 is not allocated to this transfer (vLLM may have given it to another request)
    push(p, [task("t", d, [0, 1, 2, 3], [10, 11, 12, 13], req_id="r")])
    finished, failed = d.drain_until(lambda f, x: bool(f or x))
    assert (finished, failed) == (set(), {"r"})
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "decode dropped the transfer" in out.reason
    assert_sentinel(d)
    assert d.stats.take().data["transfers_failed"] == 1
    # the connection stayed in sync: a following transfer on it works
    d.table.expect(RecvTask("r2", "t2", [40]))
    push(p, [task("t2", d, [7], [40], req_id="r2")])
    assert p.wait_state("t2", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r2"}, set())
    assert_copied(p, d, [(7, 40)])


def test_transfer_closed_on_d_before_data_is_discarded(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [1, 2, 3]))
    d.table.close("t", failed=False, reason="aborted")  # D's request ended
    assert d.table.drain() == ({"r"}, set())  # reported (as finished) so vLLM frees the blocks
    push(p, [task("t", d, [4, 5, 6], [1, 2, 3], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "decode no longer waits" in out.reason
    assert_sentinel(d)
    time.sleep(0.1)
    assert d.table.drain() == (set(), set())  # not reported a second time
    assert d.stats.take() is None  # a cancelled transfer is not a failure


def test_unknown_transfer_is_discarded_after_the_wait(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    t0 = time.monotonic()
    push(p, [task("ghost", d, [0, 1], [0, 1], req_id="r")], groups=[(0, 1, 2, 3)])
    out = p.wait_state("ghost", ["acked", "failed"])
    elapsed = time.monotonic() - t0
    assert out.state == "failed" and "decode no longer waits" in out.reason
    assert elapsed >= UNKNOWN_WAIT_S * 0.9  # waited once for the worker to learn about it...
    assert elapsed < UNKNOWN_WAIT_S + 3  # ...but TransferDone did not wait a second time
    assert_sentinel(d)
    assert d.table.drain() == (set(), set())
    # a RecvTask for it arriving after the tombstone keeps the transfer open, fed by no one
    d.table.expect(RecvTask("r", "ghost", [0, 1]))
    assert d.table.pending() == 1


def test_unreachable_decode_fails_the_transfer(p_side) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        p = p_side()
        t = SendTask(req_id="r", transfer_id="t",
                     peer=Peer("d", 1, [f"127.0.0.1:{port}"]), src_blocks=[[0]], dst_blocks=[[0]],
                     final=True, new_tokens=16)
        push(p, [t])
        out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "cannot reach decode data endpoint" in out.reason


def test_connection_killed_between_frames_fails_the_transfer(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [1, 2], [1, 2], final=False, req_id="r")])
    deadline = time.monotonic() + TIMEOUT
    while p.out("t").frames < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    for ch in list(p.sender._channels.values()):  # the P worker process dies
        ch.close()
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})


def test_decode_going_away_fails_open_transfers_on_p(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [1, 2], [1, 2], final=False, req_id="r")], groups=[(0,)])
    deadline = time.monotonic() + TIMEOUT
    while p.out("t").frames < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    d.transport.shutdown()
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "lost" in out.reason


def test_abort_from_prefill_fails_the_transfer_on_d(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [1, 2, 3]))
    push(p, [task("t", d, [1, 2, 3], [1, 2, 3], final=False, req_id="r")], groups=[(0, 1)])
    p.sender.put(AbortTransfer("t", "prefill request aborted", PEER(d)))
    out = p.wait_state("t", ["aborted", "acked", "failed"])
    assert out.state == "aborted" and out.reason == "prefill request aborted"
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    # nothing is sent for an aborted transfer any more
    push(p, [task("t", d, [4], [1], req_id="r")], groups=[(2, 3)])
    time.sleep(0.2)
    assert p.out("t").frames == 1
    assert_copied(p, d, [(1, 1), (2, 2), (3, 3)], layers=[0, 1])


def test_write_failure_on_p_fails_the_transfer_on_d_at_once(d_side, p_side,
                                                           monkeypatch) -> None:
    """A write that fails on P's side with the connection still up (a failed device copy; here
    the test-only fault hook) is aborted on D right away, and later groups are not sent."""
    monkeypatch.setenv(faults.ENV, "1")
    d, p = d_side(), p_side()
    tid = faults.WRITE_FAULT_PREFIX + "1"
    d.table.expect(RecvTask("r", tid, [1, 2]))
    push(p, [task(tid, d, [1, 2], [1, 2], req_id="r")], groups=[(0, 1), (2, 3)])
    out = p.wait_state(tid, ["failed", "acked"])
    assert out.state == "failed" and "injected write fault" in out.reason
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert out.frames == 0
    # the connection is still usable for the next transfer
    d.table.expect(RecvTask("r2", "t2", [3]))
    push(p, [task("t2", d, [3], [3], req_id="r2")])
    assert p.wait_state("t2", ["acked", "failed"]).state == "acked"


def test_abort_that_overtakes_the_recv_task_still_fails_it(d_side, p_side) -> None:
    d, p = d_side(unknown_wait_s=1.0), p_side()
    # a live connection exists (another transfer already used it)
    d.table.expect(RecvTask("r0", "t0", [0]))
    push(p, [task("t0", d, [0], [0], req_id="r0")], groups=[(0, 1, 2, 3)])
    assert p.wait_state("t0", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r0"}, set())
    # P registers t1 and aborts it before D's worker got its RecvTask
    p.sender.outgoing(task("t1", d, [1], [1], req_id="r1"))
    p.sender.put(AbortTransfer("t1", "prefill request aborted", PEER(d)))
    assert p.wait_state("t1", ["aborted"]).state == "aborted"
    time.sleep(0.1)
    d.table.expect(RecvTask("r1", "t1", [1]))
    assert d.drain_until(lambda f, x: bool(f or x), timeout=1.5) == (set(), {"r1"})


# ------------------------------------------------------------------------------ throughput


def test_large_transfer_64mib(d_side, p_side, transport) -> None:
    block_bytes, num_blocks = 256 * 1024, 64  # 4 layers x 64 blocks x 256 KiB = 64 MiB
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes)
    blocks = list(range(num_blocks))
    dst = blocks[::-1]
    # warm the connection so the handshake is not in the measurement
    d.table.expect(RecvTask("w", "warm", [0]))
    push(p, [task("warm", d, [0], [0], req_id="w")], groups=[(0,)])
    assert p.wait_state("warm", ["acked", "failed"]).state == "acked"
    d.table.drain()

    # up to three timed transfers, each checked byte for byte: a 2-core machine busy with
    # something else can slow one down, a slow path slows every one
    rates = []
    for attempt in range(3):
        tid, req = f"t{attempt}", f"r{attempt}"
        d.table.expect(RecvTask(req, tid, dst))
        t0 = time.perf_counter()
        push(p, [task(tid, d, blocks, dst, req_id=req)], groups=[(0,), (1,), (2,), (3,)])
        out = p.wait_state(tid, ["acked", "failed"], timeout=60)
        seconds = time.perf_counter() - t0
        assert out.state == "acked"
        total = NUM_LAYERS * num_blocks * block_bytes
        assert out.nbytes == total == 64 * 2**20
        rates.append(total / seconds / 1e6)
        print(f"\nLayerKV {transport} loopback: {total / 2**20:.0f} MiB in {seconds * 1e3:.1f} "
              f"ms = {rates[-1]:.0f} MB/s")
        d_views, p_views = d.layout.host_block_views(), p.layout.host_block_views()
        for layer in range(NUM_LAYERS):
            assert (d_views[layer][dst] == p_views[layer][blocks]).all()
        d.table.drain()
        if rates[-1] > 200:
            break
    assert max(rates) > 200, f"MB/s per try: {[round(r) for r in rates]}"


# ------------------------------------------------------------------------------ sizes


def test_tiny_transfer_one_block_one_layer(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [63]))
    push(p, [task("t", d, [0], [63], req_id="r")], groups=[(2,)])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "acked" and out.nbytes == BLOCK_BYTES
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, [(0, 63)], layers=[2])


def test_scattered_blocks_beyond_coalescing(d_side, p_side) -> None:
    """More runs than a layer group coalesces (NIXL then uses its prepared per-block lists)."""
    d, p = d_side(), p_side()
    src = list(range(0, 2 * (MAX_COALESCED_RUNS + 8), 2))
    dst = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - len(src), -1))
    assert len(list(block_runs(src))) > MAX_COALESCED_RUNS
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")], groups=[(0, 1), (2, 3)])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, list(zip(src, dst)))
    # the prepared lists are reused by the next request on the same connection
    d.table.expect(RecvTask("r2", "t2", dst[::-1]))
    push(p, [task("t2", d, src[::-1], dst[::-1], req_id="r2")])
    assert p.wait_state("t2", ["acked", "failed"]).state == "acked"
    assert_copied(p, d, list(zip(src, dst)))


def test_nixl_thread_pool_engine_is_byte_exact(d_side, p_side, transport) -> None:
    """nixl_num_threads > 0 (NIXL's thread-pool UCX engine): coalesced and per-block WRITEs."""
    if transport != "nixl":
        pytest.skip("a NIXL setting")
    d, p = d_side(), p_side(config=LayerKVConfig(nixl_num_threads=4))
    scattered = list(range(0, 2 * (MAX_COALESCED_RUNS + 8), 2))
    copied: list[tuple[int, int]] = []
    for tid, src, dst in [("runs", list(range(0, 20)), list(range(10, 30))),
                          ("blocks", scattered, [NUM_BLOCKS - 1 - i for i in
                                                 range(len(scattered))])]:
        d.table.expect(RecvTask(f"r-{tid}", tid, dst))
        push(p, [task(tid, d, src, dst, req_id=f"r-{tid}")])
        assert p.wait_state(tid, ["acked", "failed"]).state == "acked"
        assert d.drain_until(lambda f, x: bool(f or x)) == ({f"r-{tid}"}, set())
        copied += zip(src, dst)
        assert_copied(p, d, copied)


@pytest.mark.parametrize("transport", ["nixl+bounce"])
@pytest.mark.parametrize("threads", [4, -1])
def test_nixl_thread_pool_splits_every_ring_write_among_its_threads(
        d_side, p_side, transport, threads, monkeypatch) -> None:
    """host_bounce with nixl_num_threads=4 (also the default there, -1): each ring WRITE is one
    descriptor per thread (NIXL then moves each over its own UCX worker and connection), and
    the blocks land byte exact."""
    if transport not in TRANSPORTS:
        pytest.skip(f"{transport} is not in LAYERKV_TEST_TRANSPORTS")
    from vllm_layerkv.transport import nixl

    descriptors: list[int] = []
    cuts = nixl.span_cuts

    def counting_cuts(nbytes: int, parts: int) -> list[tuple[int, int]]:
        out = cuts(nbytes, parts)
        descriptors.append(len(out))
        return out

    monkeypatch.setattr(nixl, "span_cuts", counting_cuts)
    config = LayerKVConfig(nixl_num_threads=threads, staging_buffer_mb=8)
    d, p, src, dst, _ = eight_mib_groups(d_side, p_side, config)
    assert descriptors == [4, 4]  # one WRITE per group of 2 layers, 4 descriptors each
    assert_copied(p, d, list(zip(src, dst)))


def eight_mib_groups(d_side, p_side, config: LayerKVConfig
                     ) -> tuple[DSide, PSide, list[int], list[int], Outgoing]:
    """One transfer of 64 blocks of 64 KiB into D's blocks in reverse order, 2 layers x 64
    blocks = 8 MiB a group, acked and reported on D: (d, p, src, dst, P's outgoing state)."""
    block_bytes, num_blocks = 64 * 1024, 64
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes, config=config)
    src = list(range(num_blocks))
    dst = src[::-1]
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")])
    out = p.wait_state("t", ["acked", "failed"], timeout=30)
    assert out.state == "acked", out.reason
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    return d, p, src, dst, out


def test_many_concurrent_requests_from_three_engines(d_side, p_side) -> None:
    """3 prefill engines x 7 requests, each request 3 blocks in 2 chunks, all interleaved."""
    d = d_side()
    engines = [p_side(f"prefill-{i}", seed=100 + i) for i in range(3)]
    plan: dict[str, tuple[int, list[int], list[int]]] = {}
    free = iter(range(NUM_BLOCKS))
    for e in range(3):
        for r in range(7):
            dst = [next(free) for _ in range(3)]
            src = [(7 * e + 3 * r + k) % NUM_BLOCKS for k in range(3)]
            plan[f"e{e}r{r}"] = (e, src, dst)
            d.table.expect(RecvTask("req-" + f"e{e}r{r}", f"e{e}r{r}", dst))

    def run(e: int) -> None:
        mine = [(tid, src, dst) for tid, (eng, src, dst) in plan.items() if eng == e]
        first = [task(tid, d, src[:2], dst[:2], final=False, req_id="req-" + tid)
                 for tid, src, dst in mine]
        push(engines[e], first, step=1)
        second = [task(tid, d, src[2:], dst[2:], final=True, req_id="req-" + tid)
                  for tid, src, dst in mine]
        push(engines[e], second, step=2)

    threads = [threading.Thread(target=run, args=(e,)) for e in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tid, (e, _, _) in plan.items():
        out = engines[e].wait_state(tid, ["acked", "failed"])
        assert out.state == "acked", (tid, out.reason)
        assert out.frames == 4
    finished, failed = d.drain_until(lambda f, x: len(f) + len(x) == len(plan))
    assert failed == set() and finished == {"req-" + t for t in plan}
    for tid, (e, src, dst) in plan.items():
        for layer in range(NUM_LAYERS):
            for s, t in zip(src, dst):
                assert d.block(layer, t) == engines[e].block(layer, s), (tid, layer, s, t)
    assert d.table.pending() == 0


def test_layers_sharing_memory_are_registered_once(transport: str) -> None:
    """Hybrid models and KV-sharing layers alias one buffer from several layers; the engines
    must register it once and still address every layer."""
    from vllm_layerkv.kv.blockio import HostBlockIO
    from vllm_layerkv.kv.layout import KVLayout
    from vllm_layerkv.transport import create_transport
    from vllm_layerkv.transport.direct import memory_regions

    base = torch.zeros(NUM_BLOCKS * BLOCK_BYTES * 2, dtype=torch.uint8)
    views = [base[:NUM_BLOCKS * BLOCK_BYTES], base[:NUM_BLOCKS * BLOCK_BYTES],
             base[NUM_BLOCKS * BLOCK_BYTES // 2:][:NUM_BLOCKS * BLOCK_BYTES]]
    assert memory_regions(views) == [(base.data_ptr(), int(1.5 * NUM_BLOCKS * BLOCK_BYTES))]
    layout = KVLayout(layer_names=[f"l{i}" for i in range(3)],
                      tensors=[v.view(NUM_BLOCKS, BLOCK_BYTES) for v in views],
                      num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, device=torch.device("cpu"))
    name, config = transport_config(transport)
    mover = create_transport(name, HostBlockIO(layout), config)
    mover.shutdown()


def one_transfer(d, p) -> list[int]:
    """Send 4 scattered blocks as one request; check it is acked, reported and byte-exact.
    Returns the source blocks."""
    src, dst = [5, 6, 7, 30], [1, 2, 3, 4]
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, list(zip(src, dst)))
    return src


def test_whole_blocks_go_through_the_ring_only_with_host_bounce(d_side, p_side, transport,
                                                                 monkeypatch) -> None:
    """``host_bounce`` on: every layer group is written into a slot of D's host ring, which D
    scatters; off: straight into the KV (the ring is for head slices only)."""
    from vllm_layerkv.kv.staging import RecvRing

    granted: list[int] = []
    try_acquire = RecvRing.try_acquire

    def counting_acquire(ring: RecvRing, nbytes: int, timeout: float = 0.0) -> int | None:
        assert ring.tensor.device.type == "cpu"
        slot = try_acquire(ring, nbytes, timeout)
        if slot is not None:
            granted.append(nbytes)
        return slot

    monkeypatch.setattr(RecvRing, "try_acquire", counting_acquire)
    d, p = d_side(), p_side()
    src = one_transfer(d, p)
    if transport.endswith("+bounce"):
        assert granted == [2 * len(src) * BLOCK_BYTES] * 2  # one slot per group of 2 layers
    else:
        assert granted == []


def test_host_bounce_registers_everything_at_start_up(d_side, p_side, transport,
                                                     monkeypatch) -> None:
    """``host_bounce`` on: D's host ring and P's staging buffers are registered with the
    engine at start-up, so the first request registers no memory (on an H200 the first
    request's allocations, registrations and kernel compiles cost it about 0.8 s)."""
    if not transport.endswith("+bounce"):
        pytest.skip("only planes with host_bounce prepare anything at start-up")
    from vllm_layerkv.transport.direct import AddressedPlane
    from vllm_layerkv.transport.mooncake import MooncakePlane
    from vllm_layerkv.transport.nixl import NixlPlane

    registered: list[int] = []
    cls = {"nixl": NixlPlane, "mooncake": MooncakePlane}[transport.split("+")[0]]
    register = cls.register

    def spy(plane: AddressedPlane, t: torch.Tensor) -> None:
        registered.append(t.data_ptr())
        register(plane, t)

    monkeypatch.setattr(cls, "register", spy)
    d, p = d_side(), p_side()
    at_start = set(registered)
    ring = d.transport.receiver._host_ring
    assert ring is not None and ring.tensor.data_ptr() in at_start
    pool = p.sender._staging
    assert pool is not None and {b.data_ptr() for b in pool.buffers} <= at_start

    one_transfer(d, p)
    assert set(registered) == at_start, "the first request registered memory"


def test_host_bounce_preparation_that_fails_is_left_to_the_first_request(
        d_side, p_side, transport, monkeypatch, caplog) -> None:
    """An engine that refuses P's staging buffers at start-up does not stop the worker: P
    logs it, and the first request registers them and goes through."""
    if not transport.endswith("+bounce"):
        pytest.skip("only planes with host_bounce prepare anything at start-up")
    from vllm_layerkv.transport.mooncake import MooncakePlane
    from vllm_layerkv.transport.nixl import NixlPlane

    cls = {"nixl": NixlPlane, "mooncake": MooncakePlane}[transport.split("+")[0]]
    register = cls.register
    refusals = [RuntimeError("registration refused (test)")]

    def refuse_once(plane, t: torch.Tensor) -> None:
        if refusals:
            raise refusals.pop()
        register(plane, t)

    d = d_side()
    monkeypatch.setattr(cls, "register", refuse_once)
    with caplog.at_level(logging.WARNING, logger="vllm.layerkv.worker.sender"):
        p = p_side()
    assert ("could not prepare host_bounce at start-up (registration refused (test)); the "
            "first request will") in caplog.text
    one_transfer(d, p)


class InFlight:
    """Counts ring writes posted and not yet finished (``AddressedPeer``), and can fail the
    ``fail_post``-th post."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_post: int = 0):
        self.now = self.most = self.posted = self.finished = 0
        self._lock = threading.Lock()
        post, finish = AddressedPeer.post_staged, AddressedPeer.finish_staged

        def counting_post(peer: AddressedPeer, *args, **kw):
            with self._lock:
                self.posted += 1
                if self.posted == fail_post:
                    raise DirectWriteFailed("injected post failure (test)")
            write = post(peer, *args, **kw)
            with self._lock:
                self.now += 1
                self.most = max(self.most, self.now)
            return write

        def counting_finish(peer: AddressedPeer, write):
            try:
                return finish(peer, write)
            finally:
                with self._lock:
                    self.now -= 1
                    self.finished += 1

        monkeypatch.setattr(AddressedPeer, "post_staged", counting_post)
        monkeypatch.setattr(AddressedPeer, "finish_staged", counting_finish)


def push_all_then_send(p, monkeypatch, tasks, groups) -> None:
    """``push``, with the sender held until every item is queued: it never finds its queue
    empty in between (where it would land its writes while it waits). And a grant slower than
    usual (a loaded machine) does not make it land its oldest write early either: that is
    for a grant that waits for a ring slot, which these tests' rings always have."""
    monkeypatch.setattr(tcp_channel, "GRANT_PATIENCE_S", 1.0)
    gate = threading.Event()
    send_group = p.sender._send_group

    def held(item) -> None:
        gate.wait(TIMEOUT)
        send_group(item)

    monkeypatch.setattr(p.sender, "_send_group", held)
    push(p, tasks, groups=groups)
    gate.set()


BOUNCED = [t for t in TRANSPORTS if t.endswith("+bounce")] or ["nixl+bounce"]
"""Transports whose whole blocks go through D's ring (the pipelined path)."""


def one_mib_layers(d_side, p_side, monkeypatch, **d_kw) -> tuple[DSide, PSide, list[int]]:
    """D and P with 16 blocks of 64 KiB (1 MiB per layer = one staging buffer), P keeping up to
    3 ring writes in flight, and the blocks' ids. The writes report done only when waited for,
    so how many stay in flight does not depend on the loopback's speed."""
    monkeypatch.setattr(AddressedPeer, "staged_done", lambda peer, write: False)
    block_bytes, num_blocks = 64 * 1024, 16
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes, **d_kw)
    config = LayerKVConfig(staging_buffer_mb=1, staging_buffers=3, writes_in_flight=3)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes, config=config)
    return d, p, list(range(num_blocks))


@pytest.mark.parametrize("transport", BOUNCED)
@pytest.mark.parametrize("writes_in_flight", [1, 2, 3])
def test_ring_writes_in_flight_are_bounded_and_land_byte_exact(d_side, p_side, transport,
                                                               writes_in_flight,
                                                               monkeypatch) -> None:
    """A layer group larger than a staging buffer goes in pieces, ``writes_in_flight`` of them
    posted at once (never more, and more than one when allowed), each finished in order. The
    writes report done only when waited for (Mooncake's are done when posted, and the sender
    lands a write as soon as it is done), so the count does not depend on the transport."""
    inflight = InFlight(monkeypatch)
    monkeypatch.setattr(AddressedPeer, "staged_done", lambda peer, write: False)
    config = LayerKVConfig(staging_buffer_mb=1, staging_buffers=3,
                           writes_in_flight=writes_in_flight)
    d, p, src, dst, out = eight_mib_groups(d_side, p_side, config)
    assert out.frames == inflight.posted == inflight.finished == 16  # 2 groups x 8 MiB / 1 MiB
    assert inflight.most == writes_in_flight
    assert_copied(p, d, list(zip(src, dst)))


@pytest.mark.parametrize("transport", BOUNCED)
def test_ring_writes_stay_in_flight_from_one_layer_group_to_the_next(d_side, p_side, transport,
                                                                   monkeypatch) -> None:
    """Four one-layer groups, one staging buffer each: the sender posts the next group's write
    while the earlier ones are in flight (up to ``writes_in_flight``), not one group at a time,
    and they still land byte-exact and before TransferDone. The writes report done only when
    waited for, so the count does not depend on the loopback's speed."""
    inflight = InFlight(monkeypatch)
    d, p, src = one_mib_layers(d_side, p_side, monkeypatch)
    dst = src[::-1]
    d.table.expect(RecvTask("r", "t", dst))
    push_all_then_send(p, monkeypatch, [task("t", d, src, dst, req_id="r")],
                       groups=[(0,), (1,), (2,), (3,)])
    out = p.wait_state("t", ["acked", "failed"], timeout=30)
    assert out.state == "acked", out.reason
    assert inflight.posted == inflight.finished == 4 and inflight.most == 3
    assert out.writes_posted == 0
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    assert_copied(p, d, list(zip(src, dst)))


@pytest.mark.parametrize("transport", BOUNCED)
def test_nearly_done_estimate_counts_the_ring_writes_still_in_flight(d_side, p_side, transport,
                                                                   monkeypatch) -> None:
    """The first of four one-layer groups announces the end while its 1 MiB write is still in
    flight, on a link the sender has measured at 2 MiB/s: D is told to expect the rest no
    sooner than that write's half second on the link (posting it took next to nothing)."""
    d, p, src = one_mib_layers(d_side, p_side, monkeypatch, early_lead_s=0.0)
    p.sender.link_rate.observe(8 << 20, 4.0)
    d.table.expect(RecvTask("r", "t", src))
    t = task("t", d, src, src, req_id="r")
    p.sender.outgoing(t)
    sent = time.monotonic()
    p.sender.put(GroupSend(step=1, group=0, layers=[0], tasks=[t], announces_end=True,
                           layers_through=1, num_layers=NUM_LAYERS, t_planned=sent))
    wait_until(lambda: d.table.next_early_at() is not None)
    eta = d.table.next_early_at() - sent
    assert eta >= 0.45, f"estimate {eta:.3f} s leaves out the 1 MiB write still in flight"
    for layer in range(1, NUM_LAYERS):
        p.sender.put(GroupSend(step=1, group=layer, layers=[layer], tasks=[t]))
    p.sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))
    assert p.wait_state("t", ["acked", "failed"], timeout=30).state == "acked"


@pytest.mark.parametrize("transport", BOUNCED)
def test_more_writes_in_flight_than_ring_slots_do_not_deadlock(d_side, p_side, transport,
                                                               monkeypatch) -> None:
    """D's ring has one slot, P keeps up to three writes in flight: P's next grant waits for
    the slot its own oldest write holds, so P finishes that write while it waits, and D keeps
    reading P's reports while the grant waits (neither side blocks the other). P's writes
    report done only when waited for, so P holds them until it must."""
    inflight = InFlight(monkeypatch)
    monkeypatch.setattr(AddressedPeer, "staged_done", lambda peer, write: False)
    block_bytes, num_blocks = 64 * 1024, 64
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes, ring_slots=1)
    config = LayerKVConfig(staging_buffer_mb=1, staging_buffers=3, writes_in_flight=3)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes, config=config)
    src = list(range(num_blocks))
    dst = src[::-1]
    d.table.expect(RecvTask("r", "t", dst))
    t0 = time.monotonic()
    push(p, [task("t", d, src, dst, req_id="r")])
    out = p.wait_state("t", ["acked", "failed"], timeout=30)
    assert out.state == "acked", out.reason
    assert time.monotonic() - t0 < 2.5  # no write waited out D's ring_wait (io_timeout / 2)
    assert inflight.posted == inflight.finished == 16 and inflight.most == 1
    assert d.transport.receiver._host_ring.waits > 0
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    d_views, p_views = d.layout.host_block_views(), p.layout.host_block_views()
    for layer in range(NUM_LAYERS):
        assert (d_views[layer][dst] == p_views[layer][src]).all(), f"layer {layer}"


@pytest.mark.parametrize("transport", BOUNCED)
def test_failed_post_with_writes_in_flight_fails_the_transfer_and_frees_everything(
        d_side, p_side, transport, monkeypatch) -> None:
    """A piece that cannot be posted while others are in flight: those still finish (and are
    reported to D) before their buffers are reused, the transfer fails on both sides, no ring
    slot or staging buffer stays taken, and the connection carries the next transfer."""
    inflight = InFlight(monkeypatch, fail_post=3)
    block_bytes, num_blocks = 64 * 1024, 64
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes)
    config = LayerKVConfig(staging_buffer_mb=1, staging_buffers=2, writes_in_flight=2)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes, config=config)
    src = list(range(num_blocks))
    d.table.expect(RecvTask("r", "t", src))
    push(p, [task("t", d, src, src, req_id="r")])
    out = p.wait_state("t", ["acked", "failed"], timeout=30)
    assert out.state == "failed" and "injected post failure" in out.reason
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert inflight.posted == 3 and inflight.finished == 2 and inflight.now == 0
    assert p.sender._staging is not None and p.sender._staging.free == 2
    ring = d.transport.receiver._host_ring
    wait_until(lambda: ring is not None and sorted(ring._free) == list(range(ring.slots)))
    d.table.expect(RecvTask("r2", "t2", [3]))
    push(p, [task("t2", d, [3], [3], req_id="r2")])
    assert p.wait_state("t2", ["acked", "failed"]).state == "acked"


@pytest.mark.parametrize("transport", BOUNCED)
def test_a_write_that_fails_to_land_fails_only_its_transfer(d_side, p_side, transport,
                                                            monkeypatch) -> None:
    """Two transfers share each one-layer group, and their writes are in flight together: the
    second write to land (transfer b's first) fails. b fails on both sides, a is acked byte
    for byte, and every staging buffer and ring slot is free afterwards."""
    inflight = InFlight(monkeypatch)
    monkeypatch.setattr(AddressedPeer, "staged_done", lambda peer, write: False)
    finish = AddressedPeer.finish_staged
    landed = []

    def failing_second(peer: AddressedPeer, write):
        landed.append(write)
        if len(landed) == 2:
            finish(peer, write)
            raise DirectWriteFailed("injected landing failure (test)")
        return finish(peer, write)

    monkeypatch.setattr(AddressedPeer, "finish_staged", failing_second)
    block_bytes, num_blocks = 64 * 1024, 32  # 16 blocks per transfer: 1 MiB a layer
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes)
    config = LayerKVConfig(staging_buffer_mb=1, staging_buffers=3, writes_in_flight=3)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes, config=config)
    src_a, src_b = list(range(16)), list(range(16, 32))
    dst_a, dst_b = src_b[::-1], src_a[::-1]
    d.table.expect(RecvTask("ra", "a", dst_a))
    d.table.expect(RecvTask("rb", "b", dst_b))
    push_all_then_send(p, monkeypatch, [task("a", d, src_a, dst_a, req_id="ra"),
                                        task("b", d, src_b, dst_b, req_id="rb")],
                       groups=[(0,), (1,), (2,), (3,)])
    assert p.wait_state("a", ["acked", "failed"], timeout=30).state == "acked"
    out_b = p.wait_state("b", ["acked", "failed"], timeout=30)
    assert out_b.state == "failed" and "injected landing failure" in out_b.reason
    assert d.drain_until(lambda f, x: bool(f and x)) == ({"ra"}, {"rb"})
    assert inflight.most == 3 and inflight.now == 0
    assert p.sender._staging is not None and p.sender._staging.free == 3
    ring = d.transport.receiver._host_ring
    wait_until(lambda: ring is not None and sorted(ring._free) == list(range(ring.slots)))
    d_views, p_views = d.layout.host_block_views(), p.layout.host_block_views()
    for layer in range(NUM_LAYERS):
        assert (d_views[layer][dst_a] == p_views[layer][src_a]).all(), f"layer {layer}"


# ------------------------------------------------------------------------------ early release


def wait_until(pred, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def announce_first_group(p, d, tid: str, req_id: str, src: list[int], dst: list[int]):
    """P computed and sent the first of two groups of a final step and said the rest is near;
    the caller sends the second group (or not)."""
    t = task(tid, d, src, dst, req_id=req_id)
    p.sender.outgoing(t)
    p.sender.put(GroupSend(step=1, group=0, layers=[0, 1], tasks=[t], announces_end=True,
                           layers_through=2, num_layers=NUM_LAYERS,
                           t_planned=time.monotonic() - 0.02))
    wait_until(lambda: d.table.next_early_at() is not None)
    return t


def test_nearly_done_lets_decode_report_early_then_wait_for_the_rest(d_side, p_side) -> None:
    d, p = d_side(early_lead_s=0.0), p_side()
    src, dst = [3, 4, 5], [10, 11, 12]
    d.table.expect(RecvTask("r", "t", dst))
    t = announce_first_group(p, d, "t", "r", src, dst)
    # P's estimate: ~20 ms of compute for 2 layers -> ~20 ms for the other 2 (plus send time)
    eta = d.table.next_early_at() - time.monotonic()
    assert 0 < eta < 1.0, eta
    assert d.table.take_early(time.monotonic() - 1) == set()  # not before its time
    assert d.table.take_early(time.monotonic() + 1) == {"r"}
    assert d.table.take_early(time.monotonic() + 1) == set()  # once
    assert d.table.next_early_at() is None

    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (d.table.wait_early(["r"], TIMEOUT), waited.set()))
    waiter.start()
    time.sleep(0.2)
    assert not waited.is_set(), "the first step of an early request ran without its KV"
    p.sender.put(GroupSend(step=1, group=1, layers=[2, 3], tasks=[t]))
    p.sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))
    waiter.join(TIMEOUT)
    assert waited.is_set()
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert_copied(p, d, list(zip(src, dst)))
    assert d.table.drain() == (set(), set())  # reported early, never again
    assert d.table.drain_failed_blocks(request_failures=True) == set()
    assert d.stats.take().data["transfers_received"] == 1


class _DoneEvent:
    """A device event that has completed, ``ms`` after ``start`` (``elapsed_time``)."""

    def __init__(self, ms: float = 0.0, start: _DoneEvent | None = None):
        self.ms, self.start = ms, start

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _DoneEvent) -> float:
        return end.ms - self.ms


def test_nearly_done_estimate_counts_the_devices_time_not_the_hosts(d_side, p_side) -> None:
    """With asynchronous scheduling vLLM plans a step while the one before it still runs on
    the device: 2 s on the host's clock since the plan, 20 ms on the device for 2 of 4 layers.
    The estimate follows the device (about 20 ms left), so D can release the request early."""
    d, p = d_side(early_lead_s=0.0), p_side()
    d.table.expect(RecvTask("r", "t", [10]))
    t = task("t", d, [3], [10], req_id="r")
    p.sender.outgoing(t)
    start = _DoneEvent(0.0)
    p.sender.put(GroupSend(step=1, group=0, layers=[0, 1], tasks=[t], announces_end=True,
                           layers_through=2, num_layers=NUM_LAYERS,
                           t_planned=time.monotonic() - 2.0, step_start=start,
                           event=_DoneEvent(20.0)))
    wait_until(lambda: d.table.next_early_at() is not None)
    eta = d.table.next_early_at() - time.monotonic()
    assert eta < 0.5, f"estimate {eta:.3f} s counts the host's time before the step ran"
    p.sender.put(GroupSend(step=1, group=1, layers=[2, 3], tasks=[t]))
    p.sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"


def test_failure_after_early_release_is_a_load_error_of_the_step_that_runs_it(
        d_side, p_side, monkeypatch) -> None:
    """The last group's write fails after D reported the request: no request-level report
    (vLLM runs it already); its blocks are load errors of the step that runs it, not before."""
    monkeypatch.setenv(faults.ENV, "1")
    d, p = d_side(), p_side()
    tid = faults.LATE_WRITE_FAULT_PREFIX + "1"
    dst = [20, 21]
    d.table.expect(RecvTask("r", tid, dst))
    t = announce_first_group(p, d, tid, "r", [1, 2], dst)
    assert d.table.take_early(time.monotonic() + 1) == {"r"}
    p.sender.put(GroupSend(step=1, group=1, layers=[2, 3], tasks=[t]))
    p.sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))
    out = p.wait_state(tid, ["acked", "failed"])
    assert out.state == "failed" and "injected write fault" in out.reason
    wait_until(lambda: d.table.pending() == 0)  # D closed it on P's abort
    assert d.table.drain() == (set(), set())
    assert d.table.drain_failed_blocks(request_failures=True) == set()  # not yet: not running
    d.table.wait_early(["r"], TIMEOUT)  # the request's first step
    assert d.table.drain_failed_blocks(request_failures=False) == set(dst)
    assert d.stats.take().data["transfers_failed"] == 1
    # layers 0-1 of the first group landed before the fault; layers 2-3 never did
    views = d.layout.host_block_views()
    assert all((views[layer][b] == SENTINEL).all() for layer in (2, 3) for b in dst)


def test_early_request_whose_rest_never_comes_fails_after_the_wait(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [5]))
    announce_first_group(p, d, "t", "r", [1], [5])
    assert d.table.take_early(time.monotonic() + 1) == {"r"}
    t0 = time.monotonic()
    d.table.wait_early(["r"], 0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    assert d.table.pending() == 0
    assert d.table.drain_failed_blocks(request_failures=False) == {5}
    assert d.table.drain() == (set(), set())
    # P's late TransferDone is answered as dropped
    p.sender.put(FinishTransfer(task("t", d, [1], [5], req_id="r"), t_compute_end=0.0))
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "decode no longer waits" in out.reason


def test_early_request_that_ends_is_not_reported_again(d_side, p_side) -> None:
    d, p = d_side(), p_side()
    d.table.expect(RecvTask("r", "t", [6]))
    announce_first_group(p, d, "t", "r", [2], [6])
    assert d.table.take_early(time.monotonic() + 1) == {"r"}
    d.table.close("t", failed=False, reason="aborted")  # D's request ended
    assert d.table.drain() == (set(), set())
    d.table.wait_early(["r"], 0.1)
    assert d.table.drain_failed_blocks(request_failures=True) == set()


def test_nearly_done_for_a_closed_or_unknown_transfer_is_ignored(d_side) -> None:
    d = d_side()
    d.table.on_nearly_done("nobody", 0, 0.0)
    d.table.expect(RecvTask("r", "t", [1]))
    d.table.close("t", failed=False, reason="aborted")
    d.table.on_nearly_done("t", 0, 0.0)
    assert d.table.next_early_at() is None
    assert d.table.take_early(time.monotonic() + 1) == set()

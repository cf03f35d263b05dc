"""The data path end to end on real sockets: a prefill ``Sender`` (sender thread +
``TcpTransport`` channel) pushes KV from CPU tensors into a decode ``TcpTransport`` receiver
whose ``RecvTable`` decides what may be written. Every test checks the bytes in D's KV memory.

D's KV is filled with a sentinel first, so any byte written where it must not be shows up."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from vllm_layerkv.blockio import HostBlockIO, block_runs
from vllm_layerkv.layout import KVLayout
from vllm_layerkv.metadata import Peer, RecvTask, SendTask
from vllm_layerkv.protocol import BlockData, CompatInfo, Hello, HelloAck
from vllm_layerkv.receiver import RecvTable
from vllm_layerkv.sender import AbortTransfer, FinishTransfer, GroupSend, Outgoing, Sender
from vllm_layerkv.stats import WorkerStats
from vllm_layerkv.trace import Tracer
from vllm_layerkv.transport import faults, framing
from vllm_layerkv.transport.base import TransportError
from vllm_layerkv.transport.tcp import TcpTransport

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
    transport: TcpTransport
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


def start_d(dtype: torch.dtype = torch.uint8, num_blocks: int = NUM_BLOCKS,
            block_bytes: int = BLOCK_BYTES, info: CompatInfo | None = None,
            unknown_wait_s: float = UNKNOWN_WAIT_S, io_timeout: float = 5.0) -> DSide:
    caches = make_caches(SENTINEL, dtype, num_blocks=num_blocks, block_bytes=block_bytes)
    layout = KVLayout.from_kv_caches(caches, num_blocks)
    stats = WorkerStats()
    table = RecvTable(info or compat(block_bytes=block_bytes), tp_rank=0, tp_size=1,
                      unknown_wait_s=unknown_wait_s, stats=stats)
    transport = TcpTransport()
    endpoint = transport.start_receiver("127.0.0.1", 0, table, HostBlockIO(layout), io_timeout)
    return DSide(table, transport, endpoint, layout, stats)


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


@pytest.fixture
def d_side():
    sides: list[DSide] = []

    def make(**kw) -> DSide:
        side = start_d(**kw)
        sides.append(side)
        return side

    yield make
    for side in sides:
        side.transport.shutdown()


@pytest.fixture
def p_side():
    made: list[PSide] = []

    def make(engine_id: str = "prefill-0", dtype: torch.dtype = torch.uint8, seed: int = 1,
             info: CompatInfo | None = None, tp_size: int = 1, num_blocks: int = NUM_BLOCKS,
             block_bytes: int = BLOCK_BYTES) -> PSide:
        caches = make_caches(None, dtype, seed=seed, num_blocks=num_blocks,
                             block_bytes=block_bytes)
        layout = KVLayout.from_kv_caches(caches, num_blocks)
        stats = WorkerStats()
        hello = Hello(compat=info or compat(block_bytes=block_bytes), engine_id=engine_id,
                      tp_rank=0, tp_size=tp_size)
        sender = Sender(TcpTransport(), HostBlockIO(layout), hello, tp_rank=0,
                        connect_timeout=2.0, io_timeout=5.0, stats=stats, tracer=Tracer("", "p", 0))
        side = PSide(sender, layout, stats, engine_id)
        made.append(side)
        return side

    yield make
    for side in made:
        side.sender.shutdown()


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


# ------------------------------------------------------------------------------ refusals


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


def test_transfer_failed_on_d_is_reported_failed(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1]))
    d.table.close("t", failed=True, reason="kv_wait_timeout_s")
    assert d.table.drain() == (set(), {"r"})
    d.table.close("t", failed=True, reason="again")
    assert d.table.drain() == (set(), set())


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


def test_compat_mismatch_is_refused_with_the_field_named(d_side, p_side) -> None:
    d = d_side()
    bad = compat(block_size=32)
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(None), NUM_BLOCKS))
    with pytest.raises(TransportError) as e:
        TcpTransport().open_channel(
            d.endpoint, Hello(compat=bad, engine_id="p", tp_rank=0, tp_size=1), blocks,
            on_ack=lambda a: None, on_lost=lambda r: None, timeout=2.0, io_timeout=2.0)
    assert "refused" in str(e.value) and "block_size: 16 != 32" in str(e.value)
    # through the sender: the transfer fails with that reason, D's KV is untouched
    p = p_side(info=compat(dtype="bfloat16", model="other-model"))
    d.table.expect(RecvTask("r", "t", [1]))
    push(p, [task("t", d, [1], [1], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed"
    assert "dtype: 'uint8' != 'bfloat16'" in out.reason and "model:" in out.reason
    assert_sentinel(d)
    assert d.table.pending() == 1  # a refused sender cannot fail D's transfer either


def test_tp_mismatch_is_refused(d_side) -> None:
    d = d_side()
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(None), NUM_BLOCKS))
    with pytest.raises(TransportError, match="tensor_parallel_size"):
        TcpTransport().open_channel(
            d.endpoint, Hello(compat=compat(), engine_id="p", tp_rank=0, tp_size=2), blocks,
            on_ack=lambda a: None, on_lost=lambda r: None, timeout=2.0, io_timeout=2.0)


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


# ------------------------------------------------------------------------------ failures


def _raw_sender(d: DSide, engine_id: str = "raw-p") -> socket.socket:
    sock = framing.connect(d.endpoint, 2.0)
    framing.send_message(sock, Hello(compat=compat(), engine_id=engine_id, tp_rank=0,
                                     tp_size=1))
    assert framing.recv_message(sock) == HelloAck(tp_rank=0)
    return sock


def test_connection_killed_mid_frame_fails_the_transfer(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    d.table.expect(RecvTask("other", "t-other", [5]))  # open, but no data from this source
    sock = _raw_sender(d)
    nbytes = 2 * 2 * BLOCK_BYTES
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0, 1], dst_blocks=[1, 2],
                                         block_bytes=BLOCK_BYTES, nbytes=nbytes))
    sock.sendall(b"\x01" * (nbytes // 2))
    time.sleep(0.1)
    sock.close()
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert d.table.pending() == 1  # t-other had no data from the lost source: still waiting


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


def test_malformed_block_data_drops_the_connection(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    sock = _raw_sender(d)
    # a good frame first (so this source is known to the transfer) ...
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x07" * BLOCK_BYTES)
    # ... then a header whose nbytes does not match its blocks
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[2],
                                         block_bytes=BLOCK_BYTES, nbytes=10))
    sock.sendall(b"\x08" * 10)
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert d.block(0, 1) == b"\x07" * BLOCK_BYTES
    assert_sentinel(d, exclude={(0, 1)})
    sock.settimeout(2.0)
    with pytest.raises((framing.PeerClosed, OSError)):
        framing.recv_message(sock)
    sock.close()


def test_layer_out_of_range_is_malformed(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1]))
    sock = _raw_sender(d)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x07" * BLOCK_BYTES)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[NUM_LAYERS], dst_blocks=[1],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x08" * BLOCK_BYTES)
    assert d.drain_until(lambda f, x: bool(f or x)) == (set(), {"r"})
    assert_sentinel(d, exclude={(0, 1)})
    sock.close()


def test_close_waits_for_a_write_in_progress(d_side) -> None:
    """Memory safety: a transfer is reported (and its blocks freed by vLLM) only once no write
    into them is running."""
    d = d_side()
    d.table.expect(RecvTask("r", "t", [3]))
    sock = _raw_sender(d)
    framing.send_message(sock, BlockData(transfer_id="t", layers=[0], dst_blocks=[3],
                                         block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    sock.sendall(b"\x11" * (BLOCK_BYTES // 2))
    deadline = time.monotonic() + TIMEOUT
    while d.table._open["t"].writers != 1:  # the receiver is now inside the write
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closer = threading.Thread(target=d.table.close, args=("t", True, "kv_wait_timeout_s"))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned while a write into the blocks was in progress"
    assert d.table.drain() == (set(), set())
    sock.sendall(b"\x11" * (BLOCK_BYTES // 2))
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert d.table.drain() == (set(), {"r"})
    assert d.block(0, 3) == b"\x11" * BLOCK_BYTES  # the write finished before the report
    sock.close()


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
    monkeypatch.setattr(faults, "ENABLED", True)
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


def test_loopback_throughput_64mib(d_side, p_side) -> None:
    block_bytes, num_blocks = 256 * 1024, 64  # 4 layers x 64 blocks x 256 KiB = 64 MiB
    d = d_side(num_blocks=num_blocks, block_bytes=block_bytes)
    p = p_side(num_blocks=num_blocks, block_bytes=block_bytes)
    blocks = list(range(num_blocks))
    dst = blocks[::-1]
    d.table.expect(RecvTask("r", "t", dst))
    # warm the connection so the handshake is not in the measurement
    d.table.expect(RecvTask("w", "warm", [0]))
    push(p, [task("warm", d, [0], [0], req_id="w")], groups=[(0,)])
    assert p.wait_state("warm", ["acked", "failed"]).state == "acked"
    d.table.drain()

    t0 = time.perf_counter()
    push(p, [task("t", d, blocks, dst, req_id="r")], groups=[(0,), (1,), (2,), (3,)])
    out = p.wait_state("t", ["acked", "failed"], timeout=60)
    seconds = time.perf_counter() - t0
    assert out.state == "acked"
    total = NUM_LAYERS * num_blocks * block_bytes
    assert out.nbytes == total == 64 * 2**20
    mbps = total / seconds / 1e6
    print(f"\nLayerKV TCP loopback: {total / 2**20:.0f} MiB in {seconds * 1e3:.1f} ms "
          f"= {mbps:.0f} MB/s")
    d_views, p_views = d.layout.host_block_views(), p.layout.host_block_views()
    for layer in range(NUM_LAYERS):
        assert (d_views[layer][dst] == p_views[layer][blocks]).all()
    assert mbps > 200, f"{mbps:.0f} MB/s"

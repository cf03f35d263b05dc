"""The TCP transport's own wire: handshake refusals, malformed frames, connections cut inside a
frame, and the helpers every transport test uses (a prefill ``Sender`` pushing KV from CPU
tensors into a decode receiver whose ``RecvTable`` decides what may be written).

What every transport must do (tcp, nixl, mooncake) is in test_transport_conformance.py, on
the same helpers. D's KV is filled with a sentinel first, so any byte written where it must not
be shows up."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from vllm_layerkv.blockio import HostBlockIO
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.layout import KVLayout
from vllm_layerkv.metadata import Peer, RecvTask, SendTask
from vllm_layerkv.protocol import BlockData, CompatInfo, Hello, HelloAck
from vllm_layerkv.receiver import RecvTable
from vllm_layerkv.sender import FinishTransfer, GroupSend, Outgoing, Sender
from vllm_layerkv.stats import WorkerStats
from vllm_layerkv.trace import Tracer
from vllm_layerkv.transport import create_transport, framing
from vllm_layerkv.transport.base import Transport, TransportError
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


def start_d(dtype: torch.dtype = torch.uint8, num_blocks: int = NUM_BLOCKS,
            block_bytes: int = BLOCK_BYTES, info: CompatInfo | None = None,
            unknown_wait_s: float = UNKNOWN_WAIT_S, io_timeout: float = 5.0,
            transport: str = "tcp") -> DSide:
    caches = make_caches(SENTINEL, dtype, num_blocks=num_blocks, block_bytes=block_bytes)
    layout = KVLayout.from_kv_caches(caches, num_blocks)
    stats = WorkerStats()
    table = RecvTable(info or compat(block_bytes=block_bytes), tp_rank=0, tp_size=1,
                      unknown_wait_s=unknown_wait_s, stats=stats)
    blocks = HostBlockIO(layout)
    mover = create_transport(transport, blocks, LayerKVConfig(io_timeout_s=io_timeout))
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


@pytest.fixture
def transport() -> str:
    """The transport under test; test_transport_conformance.py parametrizes it."""
    return "tcp"


@pytest.fixture
def d_side(transport: str):
    sides: list[DSide] = []

    def make(**kw) -> DSide:
        side = start_d(transport=transport, **kw)
        sides.append(side)
        return side

    yield make
    for side in sides:
        side.transport.shutdown()


@pytest.fixture
def p_side(transport: str):
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
        blocks = HostBlockIO(layout)
        sender = Sender(create_transport(transport, blocks), blocks, hello, tp_rank=0,
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
                    src_blocks=src, dst_blocks=dst, final=final, new_tokens=16 * len(src))


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


# ------------------------------------------------------------------------------ refusals


def test_transfer_failed_on_d_is_reported_failed(d_side) -> None:
    d = d_side()
    d.table.expect(RecvTask("r", "t", [1]))
    d.table.close("t", failed=True, reason="kv_wait_timeout_s")
    assert d.table.drain() == (set(), {"r"})
    d.table.close("t", failed=True, reason="again")
    assert d.table.drain() == (set(), set())


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



def test_waiting_for_data_works_on_descriptors_above_1024() -> None:
    """vLLM processes hold many descriptors; select() fails on any >= 1024 (seen in CI-like
    runs with Mooncake engines alive), poll() does not."""
    import os

    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
    try:
        assert not framing.wait_readable(high, 0.05)
        b.sendall(b"x")
        assert framing.wait_readable(high, 1.0)
    finally:
        high.close()
        a.close()
        b.close()

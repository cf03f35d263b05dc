"""Direct writes through the grant protocol (``transport`` auto / cuda_ipc) on real sockets, on
CPU.

CUDA IPC itself needs GPUs (tests/gpu/test_cuda_ipc.py runs it across two processes). What this
file checks is everything around the mapping, which is the same code on CPU: the handshake that
offers and accepts D's KV, the grant protocol (``DirectWrite`` / ``WriteGrant`` /
``DirectWritten``) that lets D's ``RecvTable`` guard its blocks against a writer it does not
drive, the fallbacks, the block-copy function P uses, and D reading P's KV instead
(``cuda_ipc_reads``: ``DirectRead``). ``HostPeering`` stands in for the mapping only:
"exporting" registers a worker's host tensors in this process, "mapping" looks them up.
(The NIXL and Mooncake planes run for real on CPU: test_transport_conformance.py.)
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Sequence

import msgspec
import pytest
import torch
from kv_sides import (
    BLOCK_BYTES,
    NUM_BLOCKS,
    NUM_LAYERS,
    TIMEOUT,
    DSide,
    PSide,
    assert_copied,
    assert_sentinel,
    compat,
    make_caches,
    push,
    task,
)

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport import create_transport
from vllm_layerkv.transport.base import TransportError
from vllm_layerkv.transport.cuda_ipc import MAX_RUN_COPIES, CudaIpcPlane, copy_blocks
from vllm_layerkv.transport.direct import (
    READ_SIDES,
    DirectUnavailable,
    DirectWriteFailed,
    PeerReader,
    PeerWriter,
    host_id,
    paired_runs,
)
from vllm_layerkv.transport.tcp import TcpTransport
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import ChannelAuth, connect_handshake
from vllm_layerkv.wire.planes import KVExport
from vllm_layerkv.wire.protocol import DirectRead, DirectWrite, Hello, HelloAck, WriteGrant
from vllm_layerkv.worker.receiver import RecvTable
from vllm_layerkv.worker.sender import Sender, SenderParts, SenderTuning

_EXPORTED: dict[str, list[torch.Tensor]] = {}


class HostPeerKV(PeerWriter, PeerReader):
    """What ``PeerKV`` is after mapping: the peer's blocks plus a copy on them, either way.
    ``gate`` holds copies; ``fail`` makes them fail as a device copy would."""

    def __init__(self, local: list[torch.Tensor], remote: list[torch.Tensor],
                 gate: threading.Event | None, fail: bool = False):
        self._src, self._dst, self._gate, self._fail = local, remote, gate, fail
        self.description = "host-double"
        self.copies = 0
        self.reads_done = 0
        self.in_copy = threading.Event()

    def write(self, layers: Sequence[int], src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> int:
        self._hold()
        self.copies += 1
        return copy_blocks(self._src, self._dst, layers, src_blocks, dst_blocks)

    def read(self, layers: Sequence[int], src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> int:
        self._hold()
        n = copy_blocks(self._dst, self._src, layers, src_blocks, dst_blocks, READ_SIDES)
        self.reads_done += 1
        return n

    def _hold(self) -> None:
        self.in_copy.set()
        if self._gate is not None:
            assert self._gate.wait(TIMEOUT)
        if self._fail:
            raise DirectWriteFailed("device copy failed: an illegal memory access (test)")


class HostPeering(CudaIpcPlane):
    """``CudaIpcPlane`` with the CUDA IPC export / map replaced by an in-process registry."""

    def __init__(self, layout: KVLayout, gate: threading.Event | None = None,
                 mappable: bool = True, reads: bool = False, fail: bool = False):
        super().__init__(layout.block_tensors(), reads=reads)
        self._gate, self._mappable, self._fail = gate, mappable, fail
        self.mapped: list[HostPeerKV] = []

    def export_local(self) -> KVExport:
        token = uuid.uuid4().hex
        _EXPORTED[token] = self.local
        return KVExport(host_id=host_id(), device_uuid=token,
                        num_blocks=self.local[0].shape[0],
                        block_bytes=self.local[0].shape[1], layers=[])

    def map_peer(self, export: KVExport, peer: str) -> HostPeerKV:
        if not self._mappable:
            raise DirectUnavailable("peer GPU not reachable (test)")
        mapped = HostPeerKV(self.local, _EXPORTED[export.device_uuid], self._gate, self._fail)
        self.mapped.append(mapped)
        return mapped


def start_d(direct: bool = True, unknown_wait_s: float = 0.3, **peering) -> DSide:
    """``peering``: ``HostPeering``'s options for D's plane (``reads``, ``gate``, ``fail``...)."""
    layout = KVLayout.from_kv_caches(make_caches(0xA5), NUM_BLOCKS)
    stats = WorkerStats()
    table = RecvTable(compat(), tp_rank=0, tp_size=1, unknown_wait_s=unknown_wait_s,
                      stats=stats)
    plane = HostPeering(layout, **peering)
    transport = TcpTransport([plane] if direct else [])
    endpoint = transport.start_receiver("127.0.0.1", 0, table, HostBlockIO(layout), 5.0)
    d = DSide(table, transport, endpoint, layout, stats)
    d.plane = plane  # type: ignore[attr-defined]
    return d


def start_p(required: bool = False, **peering) -> tuple[PSide, HostPeering]:
    layout = KVLayout.from_kv_caches(make_caches(None, seed=1), NUM_BLOCKS)
    stats = WorkerStats()
    peering_ = HostPeering(layout, **peering)
    hello = Hello(compat=compat(), engine_id="prefill-0", tp_rank=0, tp_size=1)
    transport = TcpTransport([peering_], required="cuda_ipc" if required else "")
    sender = Sender(SenderParts(transport, HostBlockIO(layout), hello, stats=stats,
                                tracer=Tracer("", "p", 0)),
                    SenderTuning(connect_timeout_s=2.0, io_timeout_s=5.0))
    return PSide(sender, layout, stats, "prefill-0"), peering_


@pytest.fixture
def sides():
    made: list = []

    def make_d(**kw) -> DSide:
        d = start_d(**kw)
        made.append(d.transport.shutdown)
        return d

    def make_p(**kw) -> tuple[PSide, HostPeering]:
        p, peering = start_p(**kw)
        made.append(p.sender.shutdown)
        return p, peering

    yield make_d, make_p
    for stop in reversed(made):
        stop()


# ------------------------------------------------------------------------ block copies


def test_paired_runs_merge_only_what_is_adjacent_on_both_sides() -> None:
    assert paired_runs([], []) == []
    assert paired_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    assert paired_runs([4, 5, 6], [10, 11, 20]) == [(4, 10, 2), (6, 20, 1)]
    assert paired_runs([4, 6, 7], [1, 2, 3]) == [(4, 1, 1), (6, 2, 2)]
    assert paired_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]


def test_paired_runs_merge_pairs_that_count_down_on_both_sides() -> None:
    """Once vLLM's block pool has gone round, a prompt's blocks come last-freed first."""
    assert paired_runs([9, 8, 7], [5, 4, 3]) == [(7, 3, 3)]
    assert paired_runs([9, 8, 7, 1, 2], [5, 4, 3, 20, 21]) == [(7, 3, 3), (1, 20, 2)]
    assert paired_runs([5, 4, 6, 7], [9, 8, 10, 11]) == [(4, 8, 2), (6, 10, 2)]
    assert paired_runs([5, 4, 3], [9, 8, 20]) == [(4, 8, 2), (3, 20, 1)]


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "gather"])
def test_copy_blocks_copies_exactly_the_pairs(scattered: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (64, 32), generator=gen, dtype=torch.uint8) for _ in range(3)]
    dst = [torch.zeros(64, 32, dtype=torch.uint8) for _ in range(3)]
    if scattered:
        s_blocks = list(range(0, 60, 3))
        d_blocks = list(range(63, 3, -3))
        assert len(paired_runs(s_blocks, d_blocks)) > MAX_RUN_COPIES
    else:  # runs counting up and counting down
        s_blocks, d_blocks = [1, 2, 3, 10, 11, 30, 29, 28], [40, 41, 42, 5, 6, 20, 19, 18]
        assert len(paired_runs(s_blocks, d_blocks)) == 3
    n = copy_blocks(src, dst, [0, 2], s_blocks, d_blocks)
    assert n == 2 * len(s_blocks) * 32
    for layer in (0, 2):
        assert torch.equal(dst[layer][d_blocks], src[layer][s_blocks])
        others = [b for b in range(64) if b not in d_blocks]
        assert int(dst[layer][others].sum()) == 0
    assert int(dst[1].sum()) == 0  # layer not listed


def test_copy_blocks_rejects_unequal_lists() -> None:
    t = [torch.zeros(4, 8, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="differ in length"):
        copy_blocks(t, t, [0], [0, 1], [0])


# ------------------------------------------------------------------------ choosing the path


def test_cuda_ipc_needs_kv_on_a_cuda_device() -> None:
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(0), NUM_BLOCKS))
    with pytest.raises(TransportError, match="transport=cuda_ipc: needs the KV cache on a CUDA"):
        create_transport("cuda_ipc", blocks)
    assert "cuda_ipc" not in create_transport("auto", blocks).name  # nothing to map on CPU
    assert create_transport("tcp", blocks).name == "tcp"
    with pytest.raises(TransportError, match="unknown transport 'rdma'"):
        create_transport("rdma", blocks)


def test_offer_goes_only_to_senders_on_this_host() -> None:
    layout = KVLayout.from_kv_caches(make_caches(0), NUM_BLOCKS)
    peering = HostPeering(layout)
    peering.prepare()

    def hello(host: str) -> Hello:
        return Hello(compat=compat(), engine_id="p", tp_rank=0, tp_size=1, host_id=host,
                     direct=["cuda_ipc"])

    assert peering.offer(hello(host_id())) is not None
    assert peering.offer(hello("other-host/boot")) is None


# ------------------------------------------------------------------------ the grant protocol


def test_direct_transfer_is_byte_exact_acked_and_counted(sides) -> None:
    make_d, make_p = sides
    d = make_d()
    p, peering = make_p()
    src, dst = list(range(0, 20)), list(range(30, 50))
    d.table.expect(RecvTask("req-a", "tid-a", dst))
    push(p, [task("tid-a", d, src, dst, req_id="req-a")])
    out = p.wait_state("tid-a", ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert out.nbytes == NUM_LAYERS * len(src) * BLOCK_BYTES
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"req-a"}, set())
    assert_copied(p, d, list(zip(src, dst)))
    assert len(peering.mapped) == 1 and peering.mapped[0].copies == 2  # one per layer group
    assert d.stats.take().data["bytes_received"] == out.nbytes


def test_direct_transfer_of_scattered_blocks(sides) -> None:
    make_d, make_p = sides
    d = make_d()
    p, _ = make_p()
    src = list(range(0, 60, 3))
    dst = list(range(63, 3, -3))
    d.table.expect(RecvTask("r", "t", dst))
    push(p, [task("t", d, src, dst, req_id="r")], groups=[(0,), (1, 2, 3)])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert_copied(p, d, list(zip(src, dst)))


def test_grant_is_refused_for_a_transfer_closed_on_d(sides) -> None:
    make_d, make_p = sides
    d = make_d()
    p, peering = make_p()
    d.table.expect(RecvTask("r", "t", [1, 2, 3]))
    d.table.close("t", failed=False, reason="aborted")
    assert d.table.drain() == ({"r"}, set())
    push(p, [task("t", d, [4, 5, 6], [1, 2, 3], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "decode no longer waits" in out.reason
    assert peering.mapped[0].copies == 0  # P never touched D's memory
    assert_sentinel(d)


def test_grant_naming_a_foreign_block_fails_the_transfer_and_copies_nothing(sides) -> None:
    make_d, make_p = sides
    d = make_d()
    p, peering = make_p()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [4, 5], [1, 9], req_id="r")])
    assert d.drain_until(lambda f, x: bool(x)) == (set(), {"r"})
    assert peering.mapped[0].copies == 0
    assert_sentinel(d)


@pytest.mark.parametrize("reads", [False, True], ids=["p-writes", "d-reads"])
def test_close_waits_for_a_device_copy_in_progress(sides, reads: bool) -> None:
    """Memory safety: D reports a transfer (and vLLM frees its blocks) only once the granted
    copy into them has completed: P's write, or with cuda_ipc_reads D's own read."""
    make_d, make_p = sides
    gate = threading.Event()
    d = make_d(reads=True, gate=gate) if reads else make_d()
    p, p_plane = make_p(reads=True) if reads else make_p(gate=gate)
    copier = d.plane if reads else p_plane
    d.table.expect(RecvTask("r", "t", [3]))
    push(p, [task("t", d, [7], [3], req_id="r")], groups=[(0, 1, 2, 3)], finish=False)
    deadline = time.monotonic() + TIMEOUT
    while not (copier.mapped and copier.mapped[0].in_copy.is_set()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closer = threading.Thread(target=d.table.close, args=("t", True, "kv_wait_timeout_s"))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned while a copy into the blocks was running"
    assert d.table.drain() == (set(), set())
    gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert d.table.drain() == (set(), {"r"})
    assert_copied(p, d, [(7, 3)])  # the copy finished before the report


def raw_sender(d: DSide, **hello: object) -> tuple[socket.socket, object]:
    """A connection to D's receiver that sends frames by hand: the handshake, then a ``Hello``
    from "raw" with ``hello``'s fields; returns the socket and D's answer."""
    sock = framing.connect(d.endpoint, 2.0)
    connect_handshake(sock, ChannelAuth(), 2.0)
    framing.send_message(sock, Hello(compat=compat(), engine_id="raw", tp_rank=0, tp_size=1,
                                     **hello))
    return sock, framing.recv_message(sock)


def test_sender_vanishing_after_a_grant_releases_it(sides) -> None:
    """A granted copy whose sender's connection ends no longer holds the transfer open."""
    make_d, _ = sides
    d = make_d()
    d.table.expect(RecvTask("r", "t", [1]))
    sock, ack = raw_sender(d, host_id=host_id(), direct=["cuda_ipc"])
    assert isinstance(ack, HelloAck) and len(ack.exports) == 1
    framing.send_message(sock, DirectWrite(transfer_id="t", seq=1, layers=[0], dst_blocks=[1]))
    assert framing.recv_message(sock) == WriteGrant(seq=1, ok=True)
    assert d.table._open["t"].writers == 1
    sock.close()
    assert d.drain_until(lambda f, x: bool(x)) == (set(), {"r"})


def test_direct_write_without_an_offer_drops_the_connection(sides) -> None:
    make_d, _ = sides
    d = make_d()
    d.table.expect(RecvTask("r", "t", [1]))
    sock, ack = raw_sender(d)
    assert ack == HelloAck(tp_rank=0)  # did not ask: nothing offered
    framing.send_message(sock, DirectWrite(transfer_id="t", seq=1, layers=[0], dst_blocks=[1]))
    with pytest.raises((framing.PeerClosed, OSError)):
        framing.recv_message(sock)
    sock.close()
    assert_sentinel(d)


# ------------------------------------------------------------------------ fallbacks


def test_auto_sends_bytes_to_a_decode_that_offers_nothing(sides) -> None:
    make_d, make_p = sides
    d = make_d(direct=False)
    p, peering = make_p()
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [5, 6], [1, 2], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert peering.mapped == []
    assert_copied(p, d, [(5, 1), (6, 2)])


def test_auto_sends_bytes_when_the_mapping_fails(sides) -> None:
    make_d, make_p = sides
    d = make_d()
    p, _ = make_p(mappable=False)
    d.table.expect(RecvTask("r", "t", [1]))
    push(p, [task("t", d, [5], [1], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert_copied(p, d, [(5, 1)])


@pytest.mark.parametrize("d_offers", [False, True], ids=["no-offer", "unmappable"])
def test_cuda_ipc_required_fails_the_transfer_with_the_reason(sides, d_offers: bool) -> None:
    make_d, make_p = sides
    d = make_d(direct=d_offers)
    p, _ = make_p(required=True, mappable=False)
    d.table.expect(RecvTask("r", "t", [1]))
    push(p, [task("t", d, [5], [1], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed"
    assert "transport=cuda_ipc" in out.reason and "transport=auto" in out.reason
    assert ("peer GPU not reachable" if d_offers else "did not offer") in out.reason
    assert_sentinel(d)


def test_hello_from_an_older_sender_still_decodes() -> None:
    """Fields added for the direct path have defaults: a Hello without them is a byte sender."""
    enc = msgspec.msgpack.encode({"type": "Hello", "compat": msgspec.to_builtins(compat()),
                                  "engine_id": "p", "tp_rank": 0, "tp_size": 1})
    hello = msgspec.msgpack.decode(enc, type=Hello)
    assert hello.direct == [] and hello.host_id == ""


# ------------------------------------------------------------------------ decode reads


def test_decode_that_reads_copies_every_group_itself_and_p_maps_nothing(sides) -> None:
    """cuda_ipc_reads: P offers its KV, D maps it and copies each group on P's DirectRead;
    the bytes, the ack and both sides' counters are those of a write."""
    make_d, make_p = sides
    d = make_d(reads=True)
    p, p_plane = make_p(reads=True)
    src, dst = list(range(0, 20)), list(range(30, 50))
    d.table.expect(RecvTask("req-a", "tid-a", dst))
    push(p, [task("tid-a", d, src, dst, req_id="req-a")])
    out = p.wait_state("tid-a", ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert out.nbytes == NUM_LAYERS * len(src) * BLOCK_BYTES
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"req-a"}, set())
    assert_copied(p, d, list(zip(src, dst)))
    assert p_plane.mapped == []  # P mapped nothing of D's
    [reader] = d.plane.mapped
    assert reader.reads_done == 2 and reader.copies == 0  # D read each layer group
    assert d.stats.take().data["bytes_received"] == out.nbytes
    assert p.stats.take().data["bytes_sent"] == out.nbytes


@pytest.mark.parametrize("extra,reads", [({}, True), ({"cuda_ipc_reads": False}, False)],
                         ids=["default", "off"])
def test_decode_reads_by_default_and_p_writes_with_the_setting_off(
        sides, extra: dict, reads: bool) -> None:
    """kv_connector_extra_config as a user writes it: D reads unless the setting is off."""
    make_d, make_p = sides
    config = LayerKVConfig.from_extra_config(extra)
    tensors = KVLayout.from_kv_caches(make_caches(None, seed=2), NUM_BLOCKS).block_tensors()
    assert CudaIpcPlane.from_config(tensors, config, host_bounce=False).reads is reads
    d = make_d(reads=config.cuda_ipc_reads)
    p, p_plane = make_p(reads=config.cuda_ipc_reads)
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [5, 6], [1, 2], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert (len(d.plane.mapped), len(p_plane.mapped)) == ((1, 0) if reads else (0, 1))
    assert_copied(p, d, [(5, 1), (6, 2)])


@pytest.mark.parametrize("p_reads,d_reads", [(True, False), (False, True)],
                         ids=["only-p", "only-d"])
def test_reads_need_the_setting_on_both_sides(sides, p_reads: bool, d_reads: bool) -> None:
    """Without cuda_ipc_reads on P, P offers nothing of its memory; without it on D, D does not
    map P: either way P writes into D, as by default."""
    make_d, make_p = sides
    d = make_d(reads=d_reads)
    p, p_plane = make_p(reads=p_reads)
    assert (p_plane.sender_export() is not None) == p_reads
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [5, 6], [1, 2], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert len(p_plane.mapped) == 1 and p_plane.mapped[0].copies == 2
    assert d.plane.mapped == []
    assert_copied(p, d, [(5, 1), (6, 2)])


def test_decode_that_cannot_map_the_prefill_is_written_to(sides) -> None:
    make_d, make_p = sides
    d = make_d(reads=True, mappable=False)
    p, p_plane = make_p(reads=True)
    d.table.expect(RecvTask("r", "t", [1]))
    push(p, [task("t", d, [5], [1], req_id="r")])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert len(p_plane.mapped) == 1  # P writes, as without the setting
    assert_copied(p, d, [(5, 1)])


def test_failed_read_fails_the_transfer_on_both_sides(sides) -> None:
    make_d, make_p = sides
    d = make_d(reads=True, fail=True)
    p, _ = make_p(reads=True)
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [5, 6], [1, 2], req_id="r")])
    out = p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed"
    assert d.drain_until(lambda f, x: bool(x)) == (set(), {"r"})
    assert d.table._open == {}


def test_read_naming_blocks_outside_either_kv_fails_and_copies_nothing(sides) -> None:
    make_d, _ = sides
    d = make_d(reads=True)
    d.table.expect(RecvTask("r", "t", [1, 2]))
    p_layout = KVLayout.from_kv_caches(make_caches(None, seed=1), NUM_BLOCKS)
    p_plane = HostPeering(p_layout, reads=True)
    sock, ack = raw_sender(d, host_id=host_id(), direct=["cuda_ipc"],
                           exports=[p_plane.sender_export()])
    assert isinstance(ack, HelloAck) and [e.reads for e in ack.exports] == [True]
    framing.send_message(sock, DirectRead(transfer_id="t", seq=1, layers=[0],
                                          src_blocks=[NUM_BLOCKS + 5, 0], dst_blocks=[1, 2]))
    assert framing.recv_message(sock) == WriteGrant(seq=1, ok=False)
    assert d.drain_until(lambda f, x: bool(x)) == (set(), {"r"})
    assert_sentinel(d)
    sock.close()


def test_direct_read_to_a_decode_that_does_not_read_drops_the_connection(sides) -> None:
    make_d, _ = sides
    d = make_d()
    d.table.expect(RecvTask("r", "t", [1]))
    sock, ack = raw_sender(d, host_id=host_id(), direct=["cuda_ipc"])
    assert isinstance(ack, HelloAck) and [e.reads for e in ack.exports] == [False]
    framing.send_message(sock, DirectRead(transfer_id="t", seq=1, layers=[0], src_blocks=[3],
                                          dst_blocks=[1]))
    with pytest.raises((framing.PeerClosed, OSError)):
        framing.recv_message(sock)
    sock.close()
    assert_sentinel(d)

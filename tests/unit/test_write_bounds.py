"""Bounds checks on every path that writes into KV memory or a receive ring, exercised on CPU
with real objects: decode receivers (``TcpTransport`` with the NIXL and Mooncake planes, their
host-bounce rings, and the byte path) driven over real sockets by an outside sender that sends
whatever it likes, and prefill's direct writers (NIXL, Mooncake, the CUDA IPC copy) asked for
out-of-range copies. Each attack must fail its transfer (or the writer's call) with a reason
naming what is out of range, leave every byte outside the honest writes as it was (D's KV and
ring are filled with a sentinel first), and leave an honest transfer beside it unaffected.

CUDA IPC's mapping needs two GPU processes (tests/gpu/); its copy and its ring write use the
same checks as here (``copy_blocks``, ``check_staged``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
from kv_sides import (
    BLOCK_BYTES,
    NUM_BLOCKS,
    NUM_LAYERS,
    SENTINEL,
    TIMEOUT,
    DSide,
    assert_copied,
    assert_sentinel,
    compat,
    push,
    task,
)

from vllm_layerkv.kv import fused_copy
from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.bounds import BoundsError
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.kv.staging import RecvRing, StagingError, gather, scatter
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.transport.cuda_ipc import copy_blocks
from vllm_layerkv.transport.direct import AddressedPlane, DirectWriteFailed, host_id
from vllm_layerkv.transport.mooncake import MooncakePlane
from vllm_layerkv.transport.nixl import NixlPlane
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import ChannelAuth, connect_handshake
from vllm_layerkv.wire.protocol import (
    BlockData,
    DirectWrite,
    DirectWritten,
    Hello,
    HelloAck,
    Refused,
    TransferAck,
    WriteGrant,
)

BAD, GOOD = ("r-bad", "t-bad", [5, 6]), ("r-good", "t-good", [10, 11])
"""(request, transfer, D blocks) of the attacked transfer and of the honest one beside it."""
GARBAGE = 0x5A
"""What an outside sender puts in a ring slot it was granted."""


class OutsideSender:
    """A data connection to D driven one message at a time, as any peer could."""

    def __init__(self, d: DSide, direct: tuple[str, ...] = ()):
        self.sock = framing.connect(d.endpoint, TIMEOUT)
        self.sock.settimeout(TIMEOUT)
        connect_handshake(self.sock, ChannelAuth(), TIMEOUT)
        framing.send_message(self.sock, Hello(compat=compat(), engine_id="outsider", tp_rank=0,
                                              tp_size=1, host_id=host_id(),
                                              direct=list(direct)))
        ack = framing.recv_message(self.sock, HelloAck, Refused)
        assert isinstance(ack, HelloAck)
        self.exports = ack.exports

    def send(self, msg: object) -> None:
        framing.send_message(self.sock, msg)

    def grant(self) -> WriteGrant:
        msg = framing.recv_message(self.sock, TransferAck, WriteGrant)
        assert isinstance(msg, WriteGrant)
        return msg

    def dropped(self) -> bool:
        """D closed the connection."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def outsiders() -> Iterator[list[OutsideSender]]:
    made: list[OutsideSender] = []
    yield made
    for o in made:
        o.close()


def expect_both(d: DSide) -> None:
    for req, tid, blocks in (BAD, GOOD):
        d.table.expect(RecvTask(req, tid, blocks))


def honest_transfer_lands(d: DSide, p) -> None:
    """The honest transfer beside the attack: acked, byte exact, and the only bytes written."""
    push(p, [task(GOOD[1], d, [1, 2], GOOD[2], req_id=GOOD[0])])
    out = p.wait_state(GOOD[1], ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert d.drain_until(lambda f, x: bool(f))[0] == {GOOD[0]}
    assert_copied(p, d, list(zip([1, 2], GOOD[2])))


def attacked_transfer_fails(d: DSide, caplog: pytest.LogCaptureFixture, reason: str,
                            timeout: float = TIMEOUT) -> None:
    assert d.drain_until(lambda f, x: bool(x), timeout) == (set(), {BAD[0]})
    assert reason in caplog.text
    assert_sentinel(d)


# ------------------------------------------------------------------------ D: ring writes

RING_ATTACKS = {
    "heads-past-the-block": (dict(first_head=1, num_heads=1, nbytes=2 * BLOCK_BYTES),
                             "heads [1, 2) outside this rank's 1"),
    "negative-first-head": (dict(first_head=-1, num_heads=1, nbytes=2 * BLOCK_BYTES),
                            "heads [-1, 0) outside this rank's 1"),
    "more-heads-than-held": (dict(first_head=0, num_heads=2, nbytes=4 * BLOCK_BYTES),
                             "heads [0, 2) outside this rank's 1"),
    "short-payload": (dict(first_head=0, num_heads=1, nbytes=BLOCK_BYTES),
                      f"payload of {BLOCK_BYTES} B is not 1 layers x 2 blocks"),
    "negative-size": (dict(first_head=0, num_heads=-1, nbytes=-2 * BLOCK_BYTES),
                      f"a write of {-2 * BLOCK_BYTES} B into the receive ring"),
}


def ring_attack(d: DSide, raw: OutsideSender, plane: str, fields: dict) -> None:
    """Ask for a ring write with ``fields``; if granted, fill the slot as an engine would and
    report it written, then wait until D has handled the slot (freed it)."""
    raw.send(DirectWrite(transfer_id=BAD[1], seq=1, layers=[0], dst_blocks=BAD[2],
                         plane=plane, **fields))
    grant = raw.grant()
    if not grant.ok:
        return
    ring = d.transport.receiver._host_ring
    ring.tensor[grant.slot].fill_(GARBAGE)
    raw.send(DirectWritten(transfer_id=BAD[1], seq=1, nbytes=fields["nbytes"]))
    deadline = time.monotonic() + TIMEOUT
    while grant.slot not in ring._free:
        assert time.monotonic() < deadline, "D never handled the written slot"
        time.sleep(0.01)


@pytest.mark.parametrize("transport", ["nixl+bounce", "mooncake+bounce"])
@pytest.mark.parametrize("attack", list(RING_ATTACKS))
def test_ring_write_outside_its_blocks_writes_nothing(d_side, p_side, outsiders,
                                                      transport: str, attack: str) -> None:
    """A ``DirectWrite`` through D's host-bounce ring whose head range or size does not match
    D's blocks: D grants a slot when the size fits one, the sender fills it and reports it
    written, and D refuses to scatter it: no byte of the slot reaches the KV, and an honest
    transfer from another sender lands."""
    plane = transport.split("+")[0]
    d, p = d_side(), p_side()
    expect_both(d)
    raw = OutsideSender(d, direct=(plane,))
    outsiders.append(raw)
    assert any(getattr(e, "ring_slots", 0) for e in raw.exports)
    ring_attack(d, raw, plane, RING_ATTACKS[attack][0])
    assert_sentinel(d)
    honest_transfer_lands(d, p)


@pytest.mark.parametrize("transport", ["nixl+bounce"])
@pytest.mark.parametrize("attack", list(RING_ATTACKS))
def test_ring_write_outside_its_blocks_fails_its_transfer(d_side, p_side, outsiders, caplog,
                                                          transport: str, attack: str) -> None:
    """The refused write is ended (nothing written) before its transfer is failed: the
    transfer fails within 2 s with the reason, no byte of the slot reaches D's KV (the slot is
    freed), and an honest transfer from another sender lands."""
    caplog.set_level(logging.ERROR, logger="vllm.layerkv")
    fields, reason = RING_ATTACKS[attack]
    d, p = d_side(), p_side()
    expect_both(d)
    raw = OutsideSender(d, direct=("nixl",))
    outsiders.append(raw)
    t0 = time.monotonic()
    ring_attack(d, raw, "nixl", fields)
    attacked_transfer_fails(d, caplog, reason, timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert f"transfer {BAD[1]} (request {BAD[0]}) failed: " in caplog.text
    assert d.table.pending() == 1  # the honest transfer, still open beside it
    honest_transfer_lands(d, p)


# ------------------------------------------------------------------------ D: grants, frames


@pytest.mark.parametrize("transport", ["nixl"])
@pytest.mark.parametrize("layers", [[NUM_LAYERS], [-1]], ids=["past-the-end", "negative"])
def test_direct_write_naming_a_layer_outside_the_kv_drops_the_connection(
        d_side, p_side, outsiders, transport: str, layers: list[int]) -> None:
    """Refused before the grant: the sender's connection is closed (the transfer, never
    bound to it, stays D's to time out), nothing is written, an honest sender is served."""
    d, p = d_side(), p_side()
    expect_both(d)
    raw = OutsideSender(d, direct=("nixl",))
    outsiders.append(raw)
    raw.send(DirectWrite(transfer_id=BAD[1], seq=1, layers=layers, dst_blocks=BAD[2]))
    assert raw.dropped()
    assert_sentinel(d)
    honest_transfer_lands(d, p)


@pytest.mark.parametrize("transport", ["nixl"])
def test_direct_write_naming_a_block_outside_the_kv_fails_its_transfer(
        d_side, p_side, outsiders, caplog, transport: str) -> None:
    caplog.set_level(logging.ERROR, logger="vllm.layerkv")
    d, p = d_side(), p_side()
    expect_both(d)
    raw = OutsideSender(d, direct=("nixl",))
    outsiders.append(raw)
    raw.send(DirectWrite(transfer_id=BAD[1], seq=1, layers=[0], dst_blocks=[5, NUM_BLOCKS]))
    assert not raw.grant().ok
    attacked_transfer_fails(d, caplog, f"blocks [{NUM_BLOCKS}] that are not allocated")
    honest_transfer_lands(d, p)


@pytest.mark.parametrize("fields,reason", [
    (dict(layers=[0], first_head=0, num_heads=-1, block_bytes=-BLOCK_BYTES,
          nbytes=-2 * BLOCK_BYTES), "heads [0, -1) outside this rank's 1"),
    (dict(layers=[0], first_head=1, num_heads=1, block_bytes=BLOCK_BYTES,
          nbytes=2 * BLOCK_BYTES), None),
    (dict(layers=[NUM_LAYERS], block_bytes=BLOCK_BYTES, nbytes=2 * BLOCK_BYTES), None),
    (dict(layers=[0], block_bytes=BLOCK_BYTES, nbytes=3 * BLOCK_BYTES), None),
], ids=["negative-heads", "heads-past-the-block", "layer-past-the-end", "byte-count"])
def test_block_frame_outside_the_kv_writes_nothing(d_side, p_side, outsiders, caplog,
                                                   fields: dict, reason: str | None) -> None:
    """Bytes over TCP: a ``BlockData`` header whose layers, heads or byte counts do not match
    D's KV drops the connection before its payload is read into any block. One that passed
    the receiver's header checks (``reason``) is refused by the block I/O's own check, after
    the transfer was bound to the sender, so the transfer fails with the reason; one refused
    at the header was never bound to it (D's kv_wait_timeout_s ends it)."""
    caplog.set_level(logging.ERROR, logger="vllm.layerkv")
    d, p = d_side(), p_side()
    expect_both(d)
    raw = OutsideSender(d)
    outsiders.append(raw)
    raw.send(BlockData(transfer_id=BAD[1], dst_blocks=BAD[2], **fields))
    raw.sock.sendall(bytes([GARBAGE]) * 2 * BLOCK_BYTES)
    assert raw.dropped()
    if reason is not None:
        attacked_transfer_fails(d, caplog, reason)
    assert_sentinel(d)
    honest_transfer_lands(d, p)


def test_block_io_refuses_blocks_layers_and_heads_outside_the_kv() -> None:
    """The receive path's own check, behind the receiver's bookkeeping: nothing is handed out
    to be filled for a request outside the KV."""
    layout = KVLayout.from_kv_caches(kv_caches(), NUM_BLOCKS)
    io = HostBlockIO(layout)
    for layers, blocks in (([0], [NUM_BLOCKS]), ([0], [-1]), ([NUM_LAYERS], [0]),
                           ([-1], [0])):
        with pytest.raises(BoundsError, match="outside"):
            next(io.write(layers, blocks))
        with pytest.raises(BoundsError, match="outside"):
            io.read(layers, blocks)
    for first_head, num_heads in ((1, 1), (-1, 1), (0, 2), (0, -1)):
        with pytest.raises(BoundsError, match=r"heads \["):
            next(io.write_slices([0], [1], first_head, num_heads))
    for layer, view in enumerate(layout.host_block_views()):
        assert (view == SENTINEL).all(), f"layer {layer} was written"
    bufs = list(io.write([1], [3, 4]))  # an honest request still gets its buffers
    assert [len(b) for b in bufs] == [2 * BLOCK_BYTES]


# ------------------------------------------------------------------------ P: direct writers


def kv_caches(fill: int | None = SENTINEL, seed: int = 0) -> dict[str, torch.Tensor]:
    from kv_sides import make_caches

    return make_caches(fill, seed=seed)


def block_views(fill: int | None, seed: int = 0) -> list[torch.Tensor]:
    return KVLayout.from_kv_caches(kv_caches(fill, seed), NUM_BLOCKS).block_tensors()


def make_plane(name: str, local: list[torch.Tensor], host_bounce: bool) -> AddressedPlane:
    if name == "nixl":
        return NixlPlane(local, host_bounce=host_bounce)
    return MooncakePlane(local, host="127.0.0.1", host_bounce=host_bounce)


@pytest.mark.parametrize("plane_name", ["nixl", "mooncake"])
def test_engine_writer_checks_every_request_before_the_engine_moves_a_byte(
        plane_name: str) -> None:
    """P's NIXL / Mooncake writer builds engine descriptors from block ids, layers, heads and
    the ring slot D granted: each out-of-range request fails with the reason and no
    descriptor is posted (D's KV and ring keep the sentinel); honest writes then land."""
    d_kv, p_kv = block_views(SENTINEL), block_views(None, seed=1)
    ring = RecvRing(2, 2 * BLOCK_BYTES, "cpu")
    ring.tensor.fill_(SENTINEL)
    d_plane, p_plane = make_plane(plane_name, d_kv, True), make_plane(plane_name, p_kv, False)
    d_plane.prepare()
    export = d_plane.offer(Hello(compat=compat(), engine_id="p", tp_rank=0, tp_size=1,
                                 host_id=host_id(), direct=[plane_name]), ring)
    peer = p_plane.attach(export)
    staging = torch.zeros(4 * BLOCK_BYTES, dtype=torch.uint8)
    try:
        for (layers, src, dst), reason in [
            (([NUM_LAYERS], [1], [1]), "this worker's KV: layers [4] outside 0..3"),
            (([-1], [1], [1]), "this worker's KV: layers [-1]"),
            (([0], [NUM_BLOCKS], [1]), f"this worker's KV: block ids [{NUM_BLOCKS}]"),
            (([0], [1], [NUM_BLOCKS]), f"decode's KV: block ids [{NUM_BLOCKS}] outside"),
            (([0], [1], [-1]), "decode's KV: block ids [-1]"),
            (([0], [1, 2], [1]), "differ in length"),
        ]:
            with pytest.raises(DirectWriteFailed, match=reason.replace("[", r"\[")):
                peer.write(layers, src, dst)
        for (src_head, num_heads, blocks, slot), reason in [
            ((0, 1, [1], 2), "decode granted receive-ring slot [2] outside 0..1"),
            ((0, 1, [1], -1), "receive-ring slot [-1] outside"),
            ((1, 1, [1], 0), "heads [1, 2) outside this rank's 1"),
            ((0, 1, [1, 2, 3], 0), "bytes [0, 12288) outside the 8192 B region"),
        ]:
            with pytest.raises(DirectWriteFailed, match=reason.replace("[", r"\[")
                               .replace("(", r"\(").replace(")", r"\)")):
                peer.write_staged(1, [0], blocks, src_head, num_heads, staging, slot)
        assert all((t == SENTINEL).all() for t in d_kv)
        assert (ring.tensor == SENTINEL).all()

        assert peer.write([0, 3], [1, 2], [7, 9]) == 4 * BLOCK_BYTES
        assert peer.write_staged(1, [2], [4, 5], 0, 1, staging, 1) == 2 * BLOCK_BYTES
        for layer in range(NUM_LAYERS):
            for b in range(NUM_BLOCKS):
                if layer in (0, 3) and b in (7, 9):
                    assert torch.equal(d_kv[layer][b], p_kv[layer][{7: 1, 9: 2}[b]])
                else:
                    assert (d_kv[layer][b] == SENTINEL).all(), (layer, b)
        assert torch.equal(ring.tensor[1], p_kv[2][4:6].reshape(-1))
        assert (ring.tensor[0] == SENTINEL).all()
    finally:
        peer.close()
        p_plane.shutdown()
        d_plane.shutdown()


def test_cuda_ipc_copy_checks_both_sides_before_copying() -> None:
    """``copy_blocks`` is CUDA IPC's copy into D's mapped KV (on CPU tensors here)."""
    src, dst = block_views(None, seed=1), block_views(SENTINEL)
    for layers, s, t in (([NUM_LAYERS], [0], [0]), ([0], [NUM_BLOCKS], [0]),
                         ([0], [0], [NUM_BLOCKS]), ([0], [0], [-1]), ([-1], [0], [0])):
        with pytest.raises(DirectWriteFailed, match="outside"):
            copy_blocks(src, dst, layers, s, t)
    assert all((t == SENTINEL).all() for t in dst)
    assert copy_blocks(src, dst, [1], [3], [60]) == BLOCK_BYTES
    assert torch.equal(dst[1][60], src[1][3])


# ------------------------------------------------------------------------ staging and ring


def test_scatter_and_gather_refuse_what_lies_outside_the_kv() -> None:
    kv = block_views(SENTINEL)
    payload = torch.full((2 * BLOCK_BYTES // 2,), GARBAGE, dtype=torch.uint8)
    for layers, blocks, first_head, num_heads in (
            ([0], [NUM_BLOCKS], 0, 1), ([0], [-1], 0, 1), ([NUM_LAYERS], [0], 0, 1),
            ([0], [0], 2, 1), ([0], [0], -1, 1), ([0], [0], 1, 2), ([0], [0], 0, 0)):
        with pytest.raises(BoundsError):
            scatter(payload[:BLOCK_BYTES // 2], kv, layers, blocks, first_head, num_heads, 2)
        with pytest.raises(BoundsError):
            gather(kv, layers, blocks, first_head, num_heads, 2, payload)
    with pytest.raises(StagingError, match="is not 1 layers x 1 blocks"):
        scatter(payload, kv, [0], [0], 0, 1, 2)
    assert all((t == SENTINEL).all() for t in kv)
    scatter(payload[:BLOCK_BYTES // 2], kv, [2], [9], 1, 1, 2)  # the honest one lands
    assert (kv[2][9][BLOCK_BYTES // 2:] == GARBAGE).all()
    assert (kv[2][9][:BLOCK_BYTES // 2] == SENTINEL).all()


def test_receive_ring_never_hands_out_or_takes_back_a_slot_outside_it() -> None:
    ring = RecvRing(2, 1024, "cpu")
    for slot, nbytes in ((2, 16), (-1, 16), (0, 1025), (0, -1)):
        with pytest.raises(BoundsError, match="outside"):
            ring.view(slot, nbytes)
    for slot in (2, -1):
        with pytest.raises(BoundsError, match="outside"):
            ring.release(slot)
    with pytest.raises(StagingError, match="a write of -5 B"):
        ring.check_fits(-5)
    assert {ring.acquire(16, 0.1), ring.acquire(16, 0.1)} == {0, 1}


def test_fused_copy_refuses_ranges_outside_the_block_and_the_buffer() -> None:
    """The kernel computes addresses unchecked; its entry checks them (also where it then
    leaves the copy to torch)."""
    kv = block_views(SENTINEL)
    idx = torch.tensor([0, 1])
    buf = torch.zeros(2 * BLOCK_BYTES, dtype=torch.uint8)
    for layers, offset, nbytes, size in (([NUM_LAYERS], 0, 16, 64), ([0], BLOCK_BYTES - 8, 16,
                                         64), ([0], -8, 16, 64), ([0, 1], 0, BLOCK_BYTES,
                                         BLOCK_BYTES)):
        with pytest.raises(BoundsError, match="outside"):
            fused_copy.copy_slices(kv, layers, idx, offset, nbytes, buf[:size], to_buf=False)
    assert not fused_copy.copy_slices(kv, [0], idx, 0, 16, buf, to_buf=False)  # CPU: torch's

"""Frame size limits, over real TCP sockets, as a peer that sends whatever it likes would: a
length header above what the connection accepts next is refused before a byte of body is read;
a frame that announces much and sends little holds memory only for what has arrived (measured:
Python allocations for a slow frame, the process's RSS for 20 connections held open against
P's registration server); a message larger than its own type allows is refused after decoding,
naming the type, the limit and the setting; the largest honest message of every type still
passes; and honest traffic beside the attack is served."""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator

import msgspec
import pytest

from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.scheduler.registrar import RegistrationServer
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import ChannelAuth, connect_handshake
from vllm_layerkv.wire.planes import IpcTensor, KVExport, MooncakeExport, NixlExport
from vllm_layerkv.wire.protocol import (
    BLOCK_ID_BYTES,
    LIMITS,
    MESSAGE_BYTES,
    PLANE_EXPORTS_BYTES,
    PREFILL_TO_DECODE,
    REASON_CHARS,
    BlockData,
    Cancel,
    CompatInfo,
    DirectRead,
    DirectWrite,
    DirectWritten,
    FirstToken,
    Hello,
    HelloAck,
    MessageLimits,
    ProtocolError,
    Refused,
    Register,
    RegisterAck,
    StreamJoin,
    StreamJoinAck,
    TransferAbort,
    TransferAck,
    TransferDone,
    TransferNearlyDone,
    WriteGrant,
    encode,
)

TIMEOUT = 5.0
LONG_ID = "\U0001f600" * 256
"""A 256-character transfer id (the most ``request_params`` accepts) at 4 UTF-8 bytes each."""
BIG_ID = 2**31 + 12345
"""A block id that msgpack encodes in the full ``BLOCK_ID_BYTES``."""


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(sender, receiver): two ends of a loopback TCP connection."""
    srv = framing.listen("127.0.0.1", 0)
    a = framing.connect(f"127.0.0.1:{srv.getsockname()[1]}", TIMEOUT)
    b, _ = srv.accept()
    srv.close()
    b.settimeout(TIMEOUT)  # a read that waits for a body that never comes fails the test
    yield a, b
    a.close()
    b.close()


def send_later(sock: socket.socket, data: bytes) -> threading.Thread:
    """Send from another thread (a frame larger than the socket buffers)."""
    t = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    t.start()
    return t


def largest_compat() -> CompatInfo:
    return CompatInfo(vllm_version="0.26.0+cu129.dev12345", model="/m" + "x" * 4094,
                      dtype="bfloat16", kv_layout="HND", block_size=16, num_kv_heads=8,
                      head_size=128, num_layers=512, block_bytes=2**20, total_kv_heads=64,
                      kv_groups=[f"sliding:{i}x16w4096:bfloat16" for i in range(48)],
                      kv_cache_format="fp8_e4m3")


def largest_honest(kind: type, limits: MessageLimits = LIMITS) -> object:
    """The largest message of ``kind`` an honest peer makes, every field at its allowance."""
    blocks = [BIG_ID] * limits.max_transfer_blocks
    layers = list(range(40000, 40000 + 4096))
    reason = "\U0001f600" * 10 * REASON_CHARS  # cut to REASON_CHARS when made
    host = "h" * 253
    ipc = IpcTensor(handle=b"\xff" * 64, storage_size=2**40, storage_offset=2**40,
                    tensor_offset=2**40, ref_counter_handle=b"/torch_" + b"9" * 24,
                    ref_counter_offset=2**40, event_handle=b"\xff" * 64,
                    event_sync_required=True)
    made = {
        Register: lambda: Register(
            transfer_id=LONG_ID, engine_id=LONG_ID, compat=largest_compat(), tp_size=128,
            data_endpoints=[f"{host}:65535"] * 128, block_ids=[blocks[:len(blocks) // 4]] * 4,
            start_token=2**40, num_tokens=2**40, wants_first_token=True),
        Cancel: lambda: Cancel(transfer_id=LONG_ID, reason=reason),
        RegisterAck: lambda: RegisterAck(transfer_id=LONG_ID, tp_size=2**31),
        Refused: lambda: Refused(transfer_id=LONG_ID, reason=reason),
        FirstToken: lambda: FirstToken(transfer_id=LONG_ID, token_id=2**40),
        Hello: lambda: Hello(compat=largest_compat(), engine_id=LONG_ID, tp_rank=2**31,
                             tp_size=2**31, host_id=LONG_ID,
                             direct=["cuda_ipc", "nixl", "mooncake"], streams=2**31,
                             exports=[KVExport(host_id=LONG_ID, device_uuid="GPU-" + "f" * 36,
                                               num_blocks=2**31, block_bytes=2**31,
                                               layers=[ipc] * 512)]),
        StreamJoin: lambda: StreamJoin(token=LONG_ID, index=2**31),
        StreamJoinAck: lambda: StreamJoinAck(index=2**31),
        HelloAck: lambda: HelloAck(tp_rank=2**31, streams=2**31, stream_token=LONG_ID, exports=[
            KVExport(host_id=LONG_ID, device_uuid="GPU-" + "f" * 36, num_blocks=2**31,
                     block_bytes=2**31, layers=[ipc] * 512, ring=ipc, ring_slots=64,
                     ring_slot_bytes=2**32, reads=True),
            NixlExport(agent_name="layerkv-" + "f" * 12, agent_metadata=b"\xff" * (256 << 10),
                       mem_type="VRAM", device_id=7, num_blocks=2**31, block_bytes=2**31,
                       layer_addrs=[2**63] * 512, ring_addr=2**63, ring_slots=64,
                       ring_slot_bytes=2**32, ring_in_host=True, host_id=LONG_ID,
                       device_uuid="GPU-" + "f" * 36),
            MooncakeExport(session=f"{host}:65535", protocol="rdma", num_blocks=2**31,
                           block_bytes=2**31, layer_addrs=[2**63] * 512, ring_addr=2**63,
                           ring_slots=64, ring_slot_bytes=2**32, ring_in_host=True)]),
        BlockData: lambda: BlockData(transfer_id=LONG_ID, layers=layers, dst_blocks=blocks,
                                     block_bytes=2**31, nbytes=2**62, first_head=2**31,
                                     num_heads=2**31, streams=2**31),
        DirectWrite: lambda: DirectWrite(transfer_id=LONG_ID, seq=2**62, layers=layers,
                                         dst_blocks=blocks, first_head=2**31, num_heads=2**31,
                                         nbytes=2**62, plane="mooncake"),
        DirectRead: lambda: DirectRead(transfer_id=LONG_ID, seq=2**62, layers=layers,
                                       src_blocks=blocks, dst_blocks=blocks),
        WriteGrant: lambda: WriteGrant(seq=2**62, ok=True, slot=2**31),
        DirectWritten: lambda: DirectWritten(transfer_id=LONG_ID, seq=2**62, nbytes=2**62),
        TransferNearlyDone: lambda: TransferNearlyDone(transfer_id=LONG_ID, tp_rank=2**31,
                                                       eta_s=1e300),
        TransferDone: lambda: TransferDone(transfer_id=LONG_ID, tp_rank=2**31, frames=2**62,
                                           nbytes=2**62),
        TransferAbort: lambda: TransferAbort(transfer_id=LONG_ID, reason=reason),
        TransferAck: lambda: TransferAck(transfer_id=LONG_ID, ok=False, reason=reason),
    }
    return made[kind]()


def raw_frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def padded(kind: type, size: int, **fields: object) -> bytes:
    """A frame of ``kind`` with an unknown field that pads its body to ``size`` (decoders
    skip unknown fields, so only the size check can refuse it)."""
    def body(pad: int) -> bytes:
        return msgspec.msgpack.encode({"type": kind.__name__, **fields, "pad": "x" * pad})

    pad = size - len(body(0))
    while len(body(pad)) > size:  # the string's length header grows with it
        pad -= 1
    assert len(body(pad)) == size
    return raw_frame(body(pad))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------ the limits


def test_every_message_type_has_a_limit_and_control_messages_are_small() -> None:
    for kind in MESSAGE_BYTES:
        assert LIMITS.of(kind) > 0
    for kind in (Cancel, RegisterAck, Refused, FirstToken, WriteGrant, DirectWritten,
                 TransferNearlyDone, TransferDone, TransferAbort, TransferAck):
        assert LIMITS.of(kind) <= 16 << 10, kind
    # a Hello carries the sender's KV export (cuda_ipc_reads), as large as a HelloAck's
    assert LIMITS.of(Hello) <= PLANE_EXPORTS_BYTES + (32 << 10)
    assert LIMITS.of(Register) < 2 << 20  # 262,144 block ids by default
    big = MessageLimits(max_transfer_blocks=1 << 20)
    for kind in (Register, BlockData, DirectWrite):
        assert big.of(kind) - LIMITS.of(kind) == BLOCK_ID_BYTES * ((1 << 20) - (1 << 18))
    # a DirectRead lists P's blocks and D's
    assert big.of(DirectRead) - LIMITS.of(DirectRead) == 2 * BLOCK_ID_BYTES * (
        (1 << 20) - (1 << 18))


@pytest.mark.parametrize("kind", list(MESSAGE_BYTES), ids=lambda k: k.__name__)
def test_largest_honest_message_of_each_type_is_accepted(pair, kind: type) -> None:
    a, b = pair
    msg = largest_honest(kind)
    frame = encode(msg)
    assert len(frame) - 4 <= LIMITS.of(kind)
    sender = send_later(a, frame)
    assert framing.recv_message(b, kind) == msg
    sender.join(TIMEOUT)


def test_reasons_are_cut_so_that_an_honest_refusal_always_fits() -> None:
    msg = Refused(transfer_id="t", reason="x" * 100_000)
    assert len(msg.reason) == REASON_CHARS and msg.reason.endswith("...")
    assert Cancel(transfer_id="t", reason="short").reason == "short"
    assert len(encode(msg)) - 4 <= LIMITS.of(Refused)


def test_max_transfer_blocks_sets_the_largest_registration_and_frames(pair) -> None:
    a, b = pair
    limits = MessageLimits(max_transfer_blocks=1000)
    fits = largest_honest(Register, limits)
    a.sendall(encode(fits))
    assert framing.recv_message(b, Register, Cancel, limits=limits) == fits
    over = largest_honest(Register, MessageLimits(max_transfer_blocks=30_000))
    a.sendall(encode(over))
    limit = limits.of(Register)
    with pytest.raises(ProtocolError, match=rf"frame of \d+ B exceeds {limit} B, the largest "
                                            r"Register / Cancel .*max_transfer_blocks=1000 "
                                            "block ids.*raise max_transfer_blocks"):
        framing.recv_message(b, Register, Cancel, limits=limits)
    assert LayerKVConfig().max_transfer_blocks == LIMITS.max_transfer_blocks
    with pytest.raises(ConfigError, match="max_transfer_blocks=0 must be between 1 and"):
        LayerKVConfig(max_transfer_blocks=0).validate()


# ------------------------------------------------------------------------ length headers


@pytest.mark.parametrize("kinds,names", [
    ((Hello,), "Hello"),
    ((Register, Cancel), "Register / Cancel"),
    ((RegisterAck, Refused, FirstToken), "RegisterAck / Refused / FirstToken"),
    ((TransferAck, WriteGrant), "TransferAck / WriteGrant"),
    (PREFILL_TO_DECODE, "BlockData / DirectWrite / DirectRead / DirectWritten"),
], ids=["before-hello", "registrar", "register-client", "sender-acks", "data"])
def test_length_header_over_what_the_connection_accepts_is_refused_before_reading(
        pair, kinds: tuple[type, ...], names: str) -> None:
    """No body follows: a framing that waited for it would time out instead."""
    a, b = pair
    limit = LIMITS.accepting(*kinds).max_bytes
    for length in (limit + 1, 64 << 20, 2**32 - 1):
        a.sendall(struct.pack("!I", length))
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=f"frame of {length} B exceeds {limit} B, the "
                                                f"largest {names}"):
            framing.recv_message(b, *kinds)
        assert time.monotonic() - t0 < 1.0


def test_before_hello_only_a_hello_sized_frame_is_read(pair) -> None:
    a, b = pair
    a.sendall(encode(largest_honest(Register)))  # fine on a registration connection
    with pytest.raises(ProtocolError, match="the largest Hello this connection accepts"):
        framing.recv_message(b, Hello)


# ------------------------------------------------------------------------ oversize by type


@pytest.mark.parametrize("kinds,kind,fields", [
    ((Register, Cancel), Cancel, {"transfer_id": "t", "reason": "r"}),
    ((RegisterAck, Refused, FirstToken), RegisterAck, {"transfer_id": "t", "tp_size": 1}),
    ((RegisterAck, Refused, FirstToken), FirstToken, {"transfer_id": "t", "token_id": 1}),
    ((TransferAck, WriteGrant), WriteGrant, {"seq": 1, "ok": True, "slot": 0}),
    (PREFILL_TO_DECODE, TransferDone, {"transfer_id": "t", "tp_rank": 0, "frames": 1,
                                       "nbytes": 1}),
    (PREFILL_TO_DECODE, DirectWritten, {"transfer_id": "t", "seq": 1, "nbytes": 1}),
    (PREFILL_TO_DECODE, TransferAbort, {"transfer_id": "t", "reason": "r"}),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_control_message_larger_than_its_type_allows_is_refused(
        pair, kinds: tuple[type, ...], kind: type, fields: dict) -> None:
    """A frame the connection's limit lets through (it may carry a larger type) but larger
    than its own type allows: refused after decoding, naming the type and its limit."""
    a, b = pair
    size = LIMITS.of(kind) + 1
    assert size <= LIMITS.accepting(*kinds).max_bytes
    a.sendall(padded(kind, size, **fields))
    with pytest.raises(ProtocolError, match=f"{kind.__name__} of {size} B exceeds its limit of "
                                            f"{LIMITS.of(kind)} B$"):
        framing.recv_message(b, *kinds)
    a.sendall(padded(kind, size - 1, **fields))  # one byte less passes
    assert type(framing.recv_message(b, *kinds)) is kind


# ------------------------------------------------------------------------ slow frames, memory


def framing_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes allocated by the framing module and still held: the reader's buffers, without
    what other threads of the test process allocate meanwhile."""
    traces = snapshot.filter_traces([tracemalloc.Filter(True, framing.__file__)])
    return sum(stat.size for stat in traces.statistics("filename"))


def test_slow_frame_holds_memory_only_for_the_bytes_that_arrived(pair) -> None:
    """A Register announced at its full length and then trickled: the reader's buffer grows
    with what has arrived (at most twice that, or one 64 KiB chunk), not with the claim; the
    message is intact once complete; another connection is served meanwhile."""
    a, b = pair
    msg = largest_honest(Register)
    frame = encode(msg)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(framing.recv_message(b, Register)),
                              daemon=True)
    trickled = 4 + 100 * 1024
    tracemalloc.start()
    try:
        base = framing_bytes(tracemalloc.take_snapshot())
        reader.start()
        a.sendall(frame[:4])
        for i in range(4, trickled, 10 * 1024):  # then the body, 10 KiB at a time
            a.sendall(frame[i:min(i + 10 * 1024, trickled)])
            time.sleep(0.02)
        time.sleep(0.3)
        held = framing_bytes(tracemalloc.take_snapshot()) - base
    finally:
        tracemalloc.stop()
    assert reader.is_alive() and not got
    assert held < 2 * 100 * 1024 + (64 << 10), f"{held} B held for {trickled} B received"
    assert len(frame) > 10 * held  # what a buffer sized from the header would have cost
    c, d = socket.socketpair()  # honest traffic beside it
    c.sendall(encode(Cancel(transfer_id="x", reason="y")))
    assert framing.recv_message(d, Register, Cancel) == Cancel(transfer_id="x", reason="y")
    c.close()
    d.close()
    a.sendall(frame[trickled:])
    reader.join(TIMEOUT)
    assert got == [msg]


def test_twenty_connections_claiming_the_largest_registration_cost_little_rss() -> None:
    """20 connections to P's registration server each announce a Register of the largest size
    it accepts, then send nothing and stay open: the process's RSS grows by less than 16 MiB
    (a buffer sized from the header would take 20 x 1.4 MiB), and an honest registration on
    a 21st connection is answered."""
    registered: list[Register] = []

    def on_register(reg: Register) -> RegisterAck:
        registered.append(reg)
        return RegisterAck(transfer_id=reg.transfer_id, tp_size=1)

    server = RegistrationServer("127.0.0.1", 0, on_register, lambda msg: None)
    claim = struct.pack("!I", LIMITS.accepting(Register, Cancel).max_bytes)
    attackers: list[socket.socket] = []

    def connection() -> socket.socket:
        sock = framing.connect(server.endpoint, TIMEOUT)
        connect_handshake(sock, ChannelAuth(), TIMEOUT)
        attackers.append(sock)
        return sock

    try:
        warm = connection()  # thread and socket machinery paid for before measuring
        warm.sendall(claim)
        time.sleep(0.3)
        gc.collect()
        before = rss_bytes()
        for _ in range(20):
            connection().sendall(claim)
        deadline = time.monotonic() + TIMEOUT
        while server.connections < 21:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # every connection's thread is in the body read now
        grown = rss_bytes() - before
        assert grown < 16 << 20, f"RSS grew by {grown >> 20} MiB"

        honest = connection()
        reg = largest_honest(Register, MessageLimits(max_transfer_blocks=1000))
        framing.send_message(honest, reg)
        assert framing.recv_message(honest, RegisterAck, Refused) == RegisterAck(
            transfer_id=reg.transfer_id, tp_size=1)
        assert registered == [reg]
        assert server.connections == 22  # the attackers are still held, not dropped
    finally:
        for sock in attackers:
            sock.close()
        server.close()

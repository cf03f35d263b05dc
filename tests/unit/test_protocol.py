"""Wire format: every message survives encode -> socket -> framing.recv_message unchanged; the
compatibility hash and error; malformed frames are ProtocolErrors."""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys

import msgspec
import pytest

from vllm_layerkv.wire import framing
from vllm_layerkv.wire.planes import IpcTensor, KVExport, MooncakeExport, NixlExport
from vllm_layerkv.wire.protocol import (
    LIMITS,
    PROTOCOL_VERSION,
    BlockData,
    Cancel,
    CompatInfo,
    DirectWrite,
    DirectWritten,
    Hello,
    HelloAck,
    ProtocolError,
    Refused,
    Register,
    RegisterAck,
    TransferAbort,
    TransferAck,
    TransferDone,
    WriteGrant,
    compatibility_error,
    decode,
    encode,
)

COMPAT = CompatInfo(vllm_version="0.32.0", model="tiny-llama", dtype="float32", kv_layout="HND",
                    block_size=16, num_kv_heads=2, head_size=64, num_layers=8, block_bytes=16384,
                    kv_groups=["full:8x16"])

MESSAGES = [
    Register(transfer_id="t-1", engine_id="d-engine", compat=COMPAT, tp_size=2,
             data_endpoints=["10.0.0.1:9000", "[::1]:9001"], block_ids=[[7, 3, 11, 12], [0, 5]],
             start_token=16, num_tokens=60),
    Cancel(transfer_id="t-2", reason="decode request aborted"),
    RegisterAck(transfer_id="t-1", tp_size=2),
    Refused(transfer_id="t-3", reason="model: 'a' != 'b'"),
    Hello(compat=COMPAT, engine_id="p-engine", tp_rank=1, tp_size=2),
    Hello(compat=COMPAT, engine_id="p-engine", tp_rank=0, tp_size=1, host_id="h/boot",
          direct=["cuda_ipc", "nixl"]),
    HelloAck(tp_rank=1),
    HelloAck(tp_rank=0, exports=[
        KVExport(
            host_id="h/boot", device_uuid="GPU-1234", num_blocks=1000, block_bytes=65536,
            layers=[IpcTensor(handle=b"\x00\x01" * 32, storage_size=65536000,
                              storage_offset=512, tensor_offset=0,
                              ref_counter_handle=b"/torch_1_2", ref_counter_offset=3,
                              event_handle=b"", event_sync_required=False)]),
        NixlExport(agent_name="layerkv-ab12", agent_metadata=b"\x00meta" * 40,
                   mem_type="VRAM", device_id=1, num_blocks=1000, block_bytes=65536,
                   layer_addrs=[2**47 + i * 65536000 for i in range(4)]),
        MooncakeExport(session="10.0.0.2:15223", protocol="tcp", num_blocks=1000,
                       block_bytes=65536, layer_addrs=[2**40, 2**40 + 65536000]),
    ]),
    DirectWrite(transfer_id="t-1", seq=7, layers=[4, 5], dst_blocks=[9, 10]),
    WriteGrant(seq=7, ok=True),
    DirectWritten(transfer_id="t-1", seq=7, nbytes=2 * 2 * 65536),
    BlockData(transfer_id="t-1", layers=[0, 1, 2], dst_blocks=[5, 6, 9], block_bytes=4096,
              nbytes=3 * 3 * 4096),
    TransferDone(transfer_id="t-1", tp_rank=0, frames=4, nbytes=123456789012),
    TransferAbort(transfer_id="t-1", reason="prefill aborted"),
    TransferAck(transfer_id="t-1", ok=True),
    TransferAck(transfer_id="t-9", ok=False, reason="decode no longer waits"),
]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == {
        Register, Cancel, RegisterAck, Refused, Hello, HelloAck, BlockData, DirectWrite,
        WriteGrant, DirectWritten, TransferDone, TransferAbort, TransferAck}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_over_a_socket(pair, msg) -> None:
    a, b = pair
    framing.send_message(a, msg)
    got = framing.recv_message(b)
    assert type(got) is type(msg)
    assert got == msg


def test_back_to_back_frames_keep_boundaries(pair) -> None:
    a, b = pair
    a.sendall(b"".join(encode(m) for m in MESSAGES))
    assert [framing.recv_message(b) for _ in MESSAGES] == MESSAGES


def test_frame_is_length_prefixed_msgpack() -> None:
    frame = encode(HelloAck(tp_rank=3))
    (length,) = struct.unpack("!I", frame[:4])
    assert length == len(frame) - 4
    body = msgspec.msgpack.decode(frame[4:])
    # tagged union: decodable without a type
    assert body == {"type": "HelloAck", "tp_rank": 3, "exports": [], "streams": 1,
                    "stream_token": ""}
    assert decode(frame[4:]) == HelloAck(tp_rank=3)


def test_transfer_ack_reason_defaults_to_empty() -> None:
    body = msgspec.msgpack.encode({"type": "TransferAck", "transfer_id": "x", "ok": True})
    assert decode(body) == TransferAck(transfer_id="x", ok=True, reason="")


def test_compat_hash_is_stable_and_equal_for_equal_info() -> None:
    h = COMPAT.hash()
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    same = CompatInfo(**{f: getattr(COMPAT, f) for f in COMPAT.__struct_fields__})
    assert same is not COMPAT and same.hash() == h
    # and across interpreter processes (no id()/hash-seed dependence)
    code = ("from vllm_layerkv.wire.protocol import CompatInfo;"
            "print(CompatInfo(vllm_version='0.32.0', model='tiny-llama', dtype='float32', "
            "kv_layout='HND', block_size=16, num_kv_heads=2, head_size=64, num_layers=8, "
            "block_bytes=16384, kv_groups=['full:8x16']).hash())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == h


def _changed(info: CompatInfo, name: str) -> CompatInfo:
    value = getattr(info, name)
    new = (value + 1 if isinstance(value, int) else value + ["mamba:3x16"]
           if isinstance(value, list) else value + "-other")
    return msgspec.structs.replace(info, **{name: new})


@pytest.mark.parametrize("name", CompatInfo.__struct_fields__)
def test_compat_hash_is_sensitive_to_every_field(name: str) -> None:
    other = _changed(COMPAT, name)
    assert other.hash() != COMPAT.hash()


@pytest.mark.parametrize("name", CompatInfo.__struct_fields__)
def test_compatibility_error_names_the_differing_field(name: str) -> None:
    other = _changed(COMPAT, name)
    err = compatibility_error(COMPAT, other, "decode engine-7")
    assert err is not None
    assert f"{name}: {getattr(COMPAT, name)!r} != {getattr(other, name)!r}" in err
    assert "decode engine-7" in err
    others = [f for f in COMPAT.__struct_fields__ if f != name]
    assert not any(f"{f}:" in err for f in others), err  # names only what differs


def test_compatibility_error_lists_several_fields() -> None:
    other = msgspec.structs.replace(COMPAT, block_size=32, dtype="bfloat16", model="smollm2")
    err = compatibility_error(COMPAT, other, "prefill p0")
    assert err is not None
    for piece in ("block_size: 16 != 32", "dtype: 'float32' != 'bfloat16'",
                  "model: 'tiny-llama' != 'smollm2'"):
        assert piece in err


def test_compatibility_error_none_when_equal() -> None:
    assert compatibility_error(COMPAT, msgspec.structs.replace(COMPAT), "x") is None
    assert COMPAT.protocol_version == PROTOCOL_VERSION


def test_compat_differences() -> None:
    other = msgspec.structs.replace(COMPAT, num_layers=9)
    assert COMPAT.differences(other) == ["num_layers: 8 != 9"]
    assert COMPAT.differences(COMPAT) == []


@pytest.mark.parametrize("body", [
    b"\xc1",                                                    # reserved msgpack byte
    b"not msgpack at all",
    msgspec.msgpack.encode({"type": "Nope", "x": 1}),          # unknown tag
    msgspec.msgpack.encode({"type": "HelloAck"}),              # missing field
    msgspec.msgpack.encode({"type": "HelloAck", "tp_rank": "0"}),  # wrong type
    msgspec.msgpack.encode([1, 2, 3]),
])
def test_undecodable_body_is_protocol_error(pair, body: bytes) -> None:
    a, b = pair
    a.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(ProtocolError, match="undecodable"):
        framing.recv_message(b)


def test_oversize_length_prefix_is_protocol_error_before_reading_the_body(pair) -> None:
    a, b = pair
    a.sendall(struct.pack("!I", LIMITS.accepting().max_bytes + 1))  # no body follows: must not wait
    with pytest.raises(ProtocolError, match="exceeds"):
        framing.recv_message(b)


def test_eof_mid_frame_is_peer_closed(pair) -> None:
    a, b = pair
    frame = encode(Cancel(transfer_id="t", reason="r"))
    a.sendall(frame[:-2])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(framing.PeerClosed):
        framing.recv_message(b)


def test_discard_reads_exactly_n_bytes(pair) -> None:
    a, b = pair
    a.sendall(b"x" * 10000 + encode(HelloAck(tp_rank=5)))
    framing.discard(b, 10000, memoryview(bytearray(3000)))
    assert framing.recv_message(b) == HelloAck(tp_rank=5)


@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1:80", ("127.0.0.1", 80)),
    ("[::1]:9000", ("::1", 9000)),
    ("host.example:65535", ("host.example", 65535)),
])
def test_split_endpoint(address: str, expected: tuple[str, int]) -> None:
    assert framing.split_endpoint(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", "host:", "host:http", ""])
def test_split_endpoint_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        framing.split_endpoint(address)

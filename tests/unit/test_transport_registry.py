"""The registry of direct-write planes (wire/planes.py): the ``transport`` setting's names, the
export union ``HelloAck`` carries and the planes ``create_transport`` builds all come from it,
and the wire bytes of a ``HelloAck`` with exports are those of protocol version 8."""

from __future__ import annotations

import importlib

import pytest

from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.transport.direct import DirectPlane
from vllm_layerkv.wire.planes import (
    PLANES,
    TRANSPORTS,
    IpcTensor,
    KVExport,
    MooncakeExport,
    NixlExport,
    PlaneEntry,
)
from vllm_layerkv.wire.protocol import PROTOCOL_VERSION, HelloAck, decode, encode

HELLO_ACK_V10 = (
    "000002a285a474797065a848656c6c6f41636ba774705f72616e6b00a76578706f727473938aa474797065a8"
    "637564615f697063a7686f73745f6964a6682f626f6f74ab6465766963655f75756964a84750552d31323334"
    "aa6e756d5f626c6f636b73cd03e8ab626c6f636b5f6279746573ce00010000a66c61796572739188a668616e"
    "646c65c4080001000100010001ac73746f726167655f73697a65ce03e80000ae73746f726167655f6f666673"
    "6574cd0200ad74656e736f725f6f666673657400b27265665f636f756e7465725f68616e646c65c40a2f746f"
    "7263685f315f32b27265665f636f756e7465725f6f666673657403ac6576656e745f68616e646c65c400b365"
    "76656e745f73796e635f7265717569726564c2a472696e67c0aa72696e675f736c6f747300af72696e675f73"
    "6c6f745f627974657300a57265616473c28ea474797065a46e69786caa6167656e745f6e616d65a161ae6167"
    "656e745f6d65746164617461c4016da86d656d5f74797065a45652414da96465766963655f696401aa6e756d"
    "5f626c6f636b730aab626c6f636b5f627974657340ab6c617965725f616464727391cd1000a972696e675f61"
    "64647200aa72696e675f736c6f747302af72696e675f736c6f745f627974657300ac72696e675f696e5f686f"
    "7374c2a7686f73745f6964a0ab6465766963655f75756964a08aa474797065a86d6f6f6e63616b65a7736573"
    "73696f6eae31302e302e302e323a3135323233a870726f746f636f6ca3746370aa6e756d5f626c6f636b730a"
    "ab626c6f636b5f627974657340ab6c617965725f616464727391cd1000a972696e675f6164647200aa72696e"
    "675f736c6f747300af72696e675f736c6f745f627974657300ac72696e675f696e5f686f7374c2a773747265"
    "616d7301ac73747265616d5f746f6b656ea0")
"""A ``HelloAck`` with one export of each plane, as version 10 of the protocol encodes it."""


def test_transport_names_are_auto_tcp_and_each_registered_plane() -> None:
    assert TRANSPORTS == ("auto", "tcp", *(entry.name for entry in PLANES))
    assert TRANSPORTS == ("auto", "tcp", "cuda_ipc", "nixl", "mooncake")
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({"transport": "rdma"})
    for name in TRANSPORTS:
        assert f"'{name}'" in str(e.value)


@pytest.mark.parametrize("entry", PLANES, ids=lambda entry: entry.name)
def test_each_entry_names_its_plane_class_and_export(entry: PlaneEntry) -> None:
    module, _, name = entry.plane.partition(":")
    plane_class = getattr(importlib.import_module(module), name)
    assert issubclass(plane_class, DirectPlane) and plane_class.name == entry.name
    assert entry.export.__struct_config__.tag == entry.name


def test_an_entry_whose_export_has_another_tag_is_refused() -> None:
    with pytest.raises(ValueError, match="tagged 'cuda_ipc'; tag it with the plane's name"):
        PlaneEntry(name="other", export=KVExport, reach="host",
                   plane="vllm_layerkv.transport.cuda_ipc:CudaIpcPlane")
    with pytest.raises(ValueError, match="'module:Class'"):
        PlaneEntry(name="cuda_ipc", export=KVExport, reach="host", plane="CudaIpcPlane")


def test_hello_ack_with_every_export_keeps_its_wire_bytes() -> None:
    ack = HelloAck(tp_rank=0, exports=[
        KVExport(host_id="h/boot", device_uuid="GPU-1234", num_blocks=1000, block_bytes=65536,
                 layers=[IpcTensor(handle=b"\x00\x01" * 4, storage_size=65536000,
                                   storage_offset=512, tensor_offset=0,
                                   ref_counter_handle=b"/torch_1_2", ref_counter_offset=3,
                                   event_handle=b"", event_sync_required=False)]),
        NixlExport(agent_name="a", agent_metadata=b"m", mem_type="VRAM", device_id=1,
                   num_blocks=10, block_bytes=64, layer_addrs=[4096], ring_slots=2),
        MooncakeExport(session="10.0.0.2:15223", protocol="tcp", num_blocks=10, block_bytes=64,
                       layer_addrs=[4096]),
    ])
    assert PROTOCOL_VERSION == 10
    assert encode(ack).hex() == HELLO_ACK_V10
    assert decode(bytes.fromhex(HELLO_ACK_V10)[4:]) == ack

"""The registry of direct-write planes: every way P can write into D's memory itself, by name.

A plane is known on the wire by its name (P lists the planes it drives in ``Hello.direct``) and
by its export (what D offers a sender in ``HelloAck.exports``, a struct tagged with the name).
``PLANES`` holds one entry per plane, in ``transport=auto``'s order of preference; everything
else is built from it:

* ``TRANSPORTS``, the values of the ``transport`` setting (``config.py`` validates against it);
* ``PlaneExports``, the union ``HelloAck.exports`` decodes (``protocol.py``);
* the planes ``create_transport`` can build (``transport/__init__.py``), each from the
  ``DirectPlane`` subclass its entry names.

Adding a plane: write its module under ``transport/`` (a ``DirectPlane`` subclass, see
``transport/direct.py``), and here its export struct and its ``PlaneEntry``.

This module imports nothing of LayerKV, so that settings and messages can use it on any side;
an entry names its implementation as ``module:Class``, which only ``create_transport`` imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import msgspec


class DirectExport(msgspec.Struct, kw_only=True):
    """What D offers a sender for one plane: the base of every plane's export struct, each
    tagged with its plane's name."""


# ---------------------------------------------------------------- the planes' exports


class IpcTensor(msgspec.Struct, kw_only=True):
    """One layer's KV as a CUDA IPC memory handle (what torch's ``_share_cuda_`` returns)."""

    handle: bytes
    storage_size: int
    storage_offset: int
    """Bytes from the IPC allocation's base to the storage."""
    tensor_offset: int
    """Bytes from the storage to the layer's first block."""
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class KVExport(DirectExport, tag="cuda_ipc", kw_only=True):
    """D's KV cache, mappable by a process on the same host (``transport/cuda_ipc.py``)."""

    host_id: str
    device_uuid: str
    num_blocks: int
    block_bytes: int
    layers: list[IpcTensor]
    ring: IpcTensor | None = None
    """D's receive ring for head slices (offered to a sender with another TP size)."""
    ring_slots: int = 0
    ring_slot_bytes: int = 0
    reads: bool = False
    """D has mapped the sender's KV (``Hello.exports``) and copies each group itself: P sends
    ``DirectRead`` instead of writing (``cuda_ipc_reads`` on D). ``layers`` is then empty:
    P maps nothing of D's."""


class NixlExport(DirectExport, tag="nixl", kw_only=True):
    """D's KV registered with a NIXL agent (``transport/nixl.py``): P adds the agent from its
    metadata and posts WRITEs to ``layer_addrs[layer] + block * block_bytes``."""

    agent_name: str
    agent_metadata: bytes
    mem_type: str
    """"DRAM" or "VRAM"."""
    device_id: int
    num_blocks: int
    block_bytes: int
    layer_addrs: list[int]
    ring_addr: int = 0
    """D's receive ring, registered with the agent (offered to a sender with another TP size,
    or to every sender with ``host_bounce``; ``agent_metadata`` then covers it): slot ``s`` is
    at ``ring_addr + s * ring_slot_bytes``."""
    ring_slots: int = 0
    ring_slot_bytes: int = 0
    ring_in_host: bool = False
    """The ring is in D's (pinned) host memory: ``host_bounce`` is on for D, and P may send
    whole blocks through it too."""
    host_id: str = ""
    device_uuid: str = ""
    """D's host and, for VRAM, its GPU: P tells when they are its own, because UCX's
    cuda_ipc cannot copy between two processes on one GPU."""


class MooncakeExport(DirectExport, tag="mooncake", kw_only=True):
    """D's KV registered with a Mooncake TransferEngine (``transport/mooncake.py``)."""

    session: str
    """host:rpc_port of D's engine (P2P handshake, no metadata server)."""
    protocol: str
    num_blocks: int
    block_bytes: int
    layer_addrs: list[int]
    ring_addr: int = 0
    """D's receive ring, registered with the engine (as in ``NixlExport``)."""
    ring_slots: int = 0
    ring_slot_bytes: int = 0
    ring_in_host: bool = False


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class PlaneEntry:
    """One direct-write plane: its name, its export, its implementation, and what
    ``create_transport`` needs to decide whether and how to start it."""

    name: str
    """The ``transport`` setting that requires this plane, its name in ``Hello.direct``, and
    its export's tag."""
    export: type[DirectExport]
    """What D offers a sender for this plane in ``HelloAck.exports``."""
    plane: str
    """The ``DirectPlane`` subclass that implements it, as ``module:Class``; imported only when
    the plane is wanted, since an engine is an optional dependency."""
    reach: Literal["host", "network"]
    """"host": reaches decode workers on this host only; ``transport=auto`` starts every such
    plane the KV allows and prefers it for the peers it reaches. "network": reaches any host;
    ``auto`` starts the first network plane that works, in table order (one is enough)."""
    kv_device: str = ""
    """The device type the KV must be on (e.g. "cuda"); empty: any."""
    host_bounce: bool = False
    """The plane takes the ``host_bounce`` setting (whole blocks through D's receive ring in
    host memory)."""

    def __post_init__(self) -> None:
        tag = self.export.__struct_config__.tag
        if tag != self.name:
            raise ValueError(f"plane {self.name!r}: its export {self.export.__name__} is "
                             f"tagged {tag!r}; tag it with the plane's name")
        module, _, cls = self.plane.partition(":")
        if not module or not cls:
            raise ValueError(f"plane {self.name!r}: plane={self.plane!r} must name the "
                             "implementing class as 'module:Class'")


PLANES: tuple[PlaneEntry, ...] = (
    PlaneEntry(name="cuda_ipc", export=KVExport, reach="host", kv_device="cuda",
               plane="vllm_layerkv.transport.cuda_ipc:CudaIpcPlane"),
    PlaneEntry(name="nixl", export=NixlExport, reach="network", host_bounce=True,
               plane="vllm_layerkv.transport.nixl:NixlPlane"),
    PlaneEntry(name="mooncake", export=MooncakeExport, reach="network", host_bounce=True,
               plane="vllm_layerkv.transport.mooncake:MooncakePlane"),
)
"""Every plane, in ``transport=auto``'s order of preference."""

PLANES_BY_NAME: dict[str, PlaneEntry] = {entry.name: entry for entry in PLANES}
if len(PLANES_BY_NAME) != len(PLANES):
    raise ValueError(f"two planes share a name in {[entry.name for entry in PLANES]}")

TRANSPORTS: tuple[str, ...] = ("auto", "tcp", *PLANES_BY_NAME)
"""Every value of the ``transport`` setting: ``auto``, ``tcp`` (bytes only) and each plane."""

PlaneExports = Union[tuple(entry.export for entry in PLANES)]  # type: ignore[valid-type]
"""Any plane's export: the tagged union ``HelloAck.exports`` decodes."""

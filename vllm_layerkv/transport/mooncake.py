"""Mooncake plane (``transport=mooncake``, or ``auto`` when Mooncake is importable and NIXL is
not): P writes into D's KV with the Mooncake ``TransferEngine``.

* Each worker starts one engine with P2P handshake (no etcd / metadata server): its segment
  is named ``host:rpc_port`` and peers reach it directly. ``mooncake_protocol`` picks tcp or
  rdma (``mooncake_device`` names the RDMA NICs).
* Each worker registers its KV tensors with the engine at start; D offers its session name and
  per-layer base addresses in ``HelloAck``.
* P writes one batch per layer group: one entry per (layer, run of blocks adjacent on both
  sides), with ``batch_transfer_sync_write``, which returns once the batch is in D's memory
  and releases the GIL while it waits (measured), so the sender thread blocks, not the engine.
  Every entry is computed from a request ``AddressedPeer`` checked first against P's KV, D's
  export and D's ring (``kv/bounds.py``).
* Different TP (head slices): D registers its receive ring with its engine when the first such
  sender connects, before answering its Hello (P's engine fetches D's segment, registered
  buffers included, on its first write), and offers the ring's address; P registers each
  staging buffer once, on first use, and writes a gathered slice into the granted slot.
* ``host_bounce`` ("on" only; Mooncake's tcp path stages GPU memory through host buffers
  itself): the same ring in D's pinned host memory, used for whole blocks too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.transport.direct import (
    AddressedPeer,
    AddressedPlane,
    DirectUnavailable,
    DirectWriteFailed,
    RemoteKV,
    layer_geometry,
    memory_regions,
)
from vllm_layerkv.wire.planes import DirectExport, MooncakeExport

if TYPE_CHECKING:
    from vllm_layerkv.config import LayerKVConfig

logger = init_logger(__name__)
INSTALL_HINT = ("install it with: pip install 'vllm-layerkv[mooncake]' (CUDA hosts) or "
                "'vllm-layerkv[mooncake-cpu]'; the wheels need libibverbs.so.1 "
                "(Debian/Ubuntu: apt-get install libibverbs1)")


_ENGINES: list[Any] = []
"""Every engine this process made, kept until exit: destroying a TransferEngine blocks for
about a second while holding the GIL (measured), which would stall the engine's forward pass
(or, in tests, every other thread) whenever the garbage collector got to one."""


def engine_class() -> Any:
    """``mooncake.engine.TransferEngine``, or DirectUnavailable naming what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise DirectUnavailable(f"Mooncake is not usable ({e}); {INSTALL_HINT}") from None
    return TransferEngine


def transfer_engine() -> Any:
    """A new ``mooncake.engine.TransferEngine``, or DirectUnavailable naming what to install."""
    transfer_engine_class = engine_class()
    engine = transfer_engine_class()
    _ENGINES.append(engine)
    return engine


class MooncakePeer(AddressedPeer):
    """P side: one decode rank's KV, reached through this worker's transfer engine."""

    def __init__(self, plane: MooncakePlane, export: MooncakeExport):
        super().__init__(plane, RemoteKV.of(export))
        self._engine = plane.engine
        self._session = export.session
        self.description = (f"Mooncake {export.protocol}, segment {export.session}"
                            + (", through pinned host memory (host_bounce)"
                               if self.host_bounce else ""))

    def write_runs(self, layers: Sequence[int], runs: list[tuple[int, int, int]],
                   src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        bb = self.block_bytes
        srcs = [self.local_addrs[layer] + s * bb for layer in layers for s, _, _ in runs]
        dsts = [self.remote_addrs[layer] + d * bb for layer in layers for _, d, _ in runs]
        lens = [n * bb for _ in layers for _, _, n in runs]
        rc = self._engine.batch_transfer_sync_write(self._session, srcs, dsts, lens)
        if rc != 0:
            raise DirectWriteFailed(f"mooncake: batch write of {len(lens)} runs to "
                                    f"{self._session} failed (rc={rc}; see the engine's log)")

    def post_span(self, buffer: torch.Tensor, nbytes: int, remote_addr: int) -> None:
        """Synchronous: the write is complete on return (nothing for ``wait_span``)."""
        rc = self._engine.batch_transfer_sync_write(self._session, [buffer.data_ptr()],
                                                    [remote_addr], [nbytes])
        if rc != 0:
            raise DirectWriteFailed(f"mooncake: ring write of {nbytes} B to "
                                    f"{self._session} failed (rc={rc}; see the engine's log)")


class MooncakePlane(AddressedPlane):
    name = "mooncake"

    def __init__(self, local: Sequence[torch.Tensor], host: str, protocol: str = "tcp",
                 device: str = "", host_bounce: bool = False):
        super().__init__(local, host_bounce)
        self._protocol = protocol
        self.engine = transfer_engine()
        """This worker's engine, shared by its peers."""
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise DirectUnavailable(
                f"mooncake: TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}, "
                f"{device!r}) failed (rc={rc}); check host / mooncake_protocol / "
                "mooncake_device")
        self._session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        for addr, size in memory_regions(self.local):
            if self.engine.register_memory(addr, size) != 0:
                self.shutdown()
                raise DirectUnavailable("mooncake: cannot register the KV cache with the "
                                        "transfer engine (see the engine's log)")
            self._registered.append(addr)

    @classmethod
    def check_installed(cls) -> None:
        engine_class()

    @classmethod
    def from_config(cls, local: Sequence[torch.Tensor], config: LayerKVConfig,
                    host_bounce: bool) -> MooncakePlane:
        return cls(local, host=config.host, protocol=config.mooncake_protocol,
                   device=config.mooncake_device, host_bounce=host_bounce)

    def prepare(self) -> None:
        self._export = MooncakeExport(session=self._session, protocol=self._protocol,
                                      **layer_geometry(self.local))

    def attach(self, export: DirectExport) -> MooncakePeer:
        assert isinstance(export, MooncakeExport)
        return MooncakePeer(self, export)

    def register(self, t: torch.Tensor) -> None:
        addr = t.data_ptr()
        if addr in self._registered:
            return
        if self.engine.register_memory(addr, t.numel() * t.element_size()) != 0:
            raise DirectUnavailable(f"mooncake: cannot register {t.numel()} B at {addr:#x} "
                                    "with the transfer engine (see the engine's log)")
        self._registered.append(addr)

    def shutdown(self) -> None:
        for ptr in self._registered:
            try:
                self.engine.unregister_memory(ptr)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self._registered.clear()

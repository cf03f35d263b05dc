"""Byte movers behind one interface (base.py).

The embedded TCP transport (``tcp.py``) carries every control message and, unless a direct
plane serves the peer, the KV bytes. Direct planes (``direct.py``) let P write into D's memory
itself: CUDA IPC between GPUs of one host (``cuda_ipc.py``), NIXL (``nixl.py``), Mooncake
(``mooncake.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.config import TRANSPORTS
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.transport.base import (
    ReceiveSink,
    SendChannel,
    Transport,
    TransportError,
)
from vllm_layerkv.transport.direct import DirectPlane, DirectUnavailable

if TYPE_CHECKING:
    from vllm_layerkv.config import LayerKVConfig

logger = init_logger(__name__)


def create_transport(name: str, blocks: BlockIO, config: LayerKVConfig | None = None
                     ) -> Transport:
    """The transport for setting ``transport``:

    * ``tcp``: bytes over TCP (zero-copy on CPU, a pinned staging buffer on GPU);
    * ``cuda_ipc`` / ``nixl`` / ``mooncake``: that direct plane or nothing (a peer it cannot
      reach fails the transfer with the reason);
    * ``auto``: CUDA IPC for a same-host peer when the KV is on CUDA, else NIXL if it is
      installed, else Mooncake if it is installed, else bytes over TCP. The choice and the
      reason are logged here and again per peer when its channel opens.
    """
    from vllm_layerkv.config import LayerKVConfig
    from vllm_layerkv.transport.tcp import TcpTransport

    if name not in TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; use one of {list(TRANSPORTS)}")
    config = config or LayerKVConfig()
    ring = {"ring_slots": config.recv_ring_slots,
            "ring_slot_bytes": config.staging_buffer_mb << 20}
    if name == "tcp":
        return TcpTransport(**ring)
    if name != "auto":
        try:
            plane = _make_plane(name, blocks, config)
        except DirectUnavailable as e:
            raise TransportError(f"transport={name}: {e}; or use transport=auto / tcp") from None
        return TcpTransport([plane], required=name, **ring)

    planes: list[DirectPlane] = []
    notes: list[str] = []
    candidates = ["cuda_ipc"] if blocks.tensors[0].device.type == "cuda" else []
    if not candidates:
        notes.append("cuda_ipc: KV is in host memory")
    for network in ("nixl", "mooncake"):  # one network plane is enough, NIXL first
        try:
            planes.append(_make_plane(network, blocks, config))
            break
        except Exception as e:  # noqa: BLE001 - auto never fails over an optional engine
            notes.append(f"{network}: {e}")
    for c in candidates:
        planes.insert(0, _make_plane(c, blocks, config))
    chosen = " > ".join([p.name for p in planes] + ["tcp"])
    logger.info("LayerKV transport=auto: %s (%s)", chosen,
                "; ".join(notes) if notes else "every plane available")
    return TcpTransport(planes, **ring)


def _make_plane(name: str, blocks: BlockIO, config: LayerKVConfig) -> DirectPlane:
    if name == "cuda_ipc":
        if blocks.tensors[0].device.type != "cuda":
            raise DirectUnavailable("needs the KV cache on a CUDA device, but this worker's KV "
                                    "is in host memory")
        from vllm_layerkv.transport.cuda_ipc import CudaIpcPlane

        return CudaIpcPlane(blocks.tensors)
    if name == "nixl":
        from vllm_layerkv.transport.nixl import NixlPlane, nixl_api

        nixl_api()  # the install hint before anything else
        return NixlPlane(blocks.tensors, backends=config.nixl_backends.split(","),
                         io_timeout=config.io_timeout_s, num_threads=config.nixl_num_threads,
                         host_bounce=_host_bounce(name, blocks, config))
    if name == "mooncake":
        from vllm_layerkv.transport.mooncake import MooncakePlane

        return MooncakePlane(blocks.tensors, host=config.host, protocol=config.mooncake_protocol,
                             device=config.mooncake_device,
                             host_bounce=_host_bounce(name, blocks, config))
    raise DirectUnavailable(f"no direct plane named {name!r}")


def host_bounce_for(plane: str, setting: str, kv_device: str, nixl_backends: str,
                    ucx_tls: str | None) -> tuple[bool, str]:
    """``host_bounce`` resolved for a network plane, and why (logged at start). "auto" bounces
    only NIXL over UCX when ``UCX_TLS`` leaves UCX no transport that reaches GPU memory: UCX
    then stages GPU memory through host buffers itself, slowly (0.47 GB/s on an H200 over
    tcp). Mooncake's tcp path stages through host memory itself, and its rdma path reaches GPU
    memory, so "auto" leaves it alone."""
    if setting != "auto":
        return setting == "on", f"host_bounce={setting}"
    if kv_device != "cuda":
        return False, "the KV is in host memory"
    if plane != "nixl":
        return False, f"{plane} moves GPU memory itself"
    if [b.strip() for b in nixl_backends.split(",")] != ["UCX"]:
        return False, f"nixl_backends={nixl_backends} (decided for UCX only)"
    from vllm_layerkv.transport.nixl import ucx_reaches_gpu

    reaches, why = ucx_reaches_gpu(ucx_tls)
    return not reaches, why


def _host_bounce(plane: str, blocks: BlockIO, config: LayerKVConfig) -> bool:
    on, why = host_bounce_for(plane, config.host_bounce, blocks.tensors[0].device.type,
                              config.nixl_backends, os.environ.get("UCX_TLS"))
    logger.info("LayerKV %s: host_bounce %s (%s)", plane, "on" if on else "off", why)
    return on


__all__ = ["TRANSPORTS", "ReceiveSink", "SendChannel", "Transport", "TransportError",
           "create_transport"]

"""Byte movers behind one interface (base.py).

The embedded TCP transport (``tcp.py``) carries every control message and, unless a direct
plane serves the peer, the KV bytes. Direct planes (``direct.py``) let P write into D's memory
itself: CUDA IPC between GPUs of one host (``cuda_ipc.py``), NIXL (``nixl.py``), Mooncake
(``mooncake.py``). The planes are registered in ``wire/planes.py``; ``create_transport``
builds whichever the ``transport`` setting asks for from there.
"""

from __future__ import annotations

import importlib
import os

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.transport.base import (
    ReceiveSink,
    SendChannel,
    Transport,
    TransportError,
)
from vllm_layerkv.transport.direct import DirectPlane, DirectUnavailable
from vllm_layerkv.transport.tcp import TcpTransport
from vllm_layerkv.transport.tcp_receiver import RingShape
from vllm_layerkv.wire.admission import ListenerLimits
from vllm_layerkv.wire.auth import ChannelAuth
from vllm_layerkv.wire.planes import PLANES, PLANES_BY_NAME, TRANSPORTS, PlaneEntry

logger = init_logger(__name__)


def create_transport(name: str, blocks: BlockIO, config: LayerKVConfig | None = None
                     ) -> Transport:
    """The transport for setting ``transport``:

    * ``tcp``: bytes over TCP (zero-copy on CPU, a pinned staging buffer on GPU);
    * a plane's name (``cuda_ipc`` / ``nixl`` / ``mooncake``): that direct plane or nothing (a
      peer it cannot reach fails the transfer with the reason);
    * ``auto``: in the registry's order, every same-host plane the KV allows (CUDA IPC when
      the KV is on CUDA), then the first network plane that starts (NIXL if it is installed,
      else Mooncake if it is installed), then bytes over TCP. The choice and the reason are
      logged here and again per peer when its channel opens.
    """
    if name not in TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; use one of {list(TRANSPORTS)}")
    config = config or LayerKVConfig()
    ring = RingShape(slots=config.recv_ring_slots, slot_bytes=config.staging_buffer_mb << 20)
    pacing = config.tcp_pacing_gbps
    streams = config.tcp_streams
    auth = ChannelAuth.from_config(config)  # every connection authenticates
    limits = ListenerLimits.from_config(config)
    if name == "tcp":
        return TcpTransport(ring=ring, pacing_gbps=pacing, auth=auth, limits=limits,
                            streams=streams)
    if name != "auto":
        try:
            plane = _make_plane(PLANES_BY_NAME[name], blocks, config)
        except DirectUnavailable as e:
            raise TransportError(f"transport={name}: {e}; or use transport=auto / tcp") from None
        return TcpTransport([plane], required=name, ring=ring, pacing_gbps=pacing, auth=auth,
                            limits=limits, streams=streams)

    planes: list[DirectPlane] = []
    notes: list[str] = []
    kv_device = blocks.tensors[0].device.type
    usable: list[PlaneEntry] = []
    for entry in PLANES:
        if entry.kv_device and entry.kv_device != kv_device:
            notes.append(f"{entry.name}: KV is in {_memory(kv_device)}")
        else:
            usable.append(entry)
    for entry in usable:
        if entry.reach == "host":
            planes.append(_make_plane(entry, blocks, config))
    for entry in usable:  # one network plane is enough, the first that starts
        if entry.reach == "network":
            try:
                planes.append(_make_plane(entry, blocks, config))
                break
            except Exception as e:  # noqa: BLE001 - auto never fails over an optional engine
                notes.append(f"{entry.name}: {e}")
    chosen = " > ".join([p.name for p in planes] + ["tcp"])
    logger.info("LayerKV transport=auto: %s (%s)", chosen,
                "; ".join(notes) if notes else "every plane available")
    return TcpTransport(planes, ring=ring, pacing_gbps=pacing, auth=auth, limits=limits,
                        streams=streams)


def _make_plane(entry: PlaneEntry, blocks: BlockIO, config: LayerKVConfig) -> DirectPlane:
    """Build the plane of a registry entry for this worker (raises DirectUnavailable)."""
    kv_device = blocks.tensors[0].device.type
    if entry.kv_device and entry.kv_device != kv_device:
        raise DirectUnavailable(f"needs the KV cache on a {entry.kv_device.upper()} device, but "
                                f"this worker's KV is in {_memory(kv_device)}")
    module, _, cls = entry.plane.partition(":")
    plane_class: type[DirectPlane] = getattr(importlib.import_module(module), cls)
    plane_class.check_installed()  # the install hint before anything else
    host_bounce = entry.host_bounce and _host_bounce(entry.name, blocks, config)
    return plane_class.from_config(blocks.tensors, config, host_bounce)


def _memory(device_type: str) -> str:
    return "host memory" if device_type == "cpu" else f"{device_type} memory"


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
           "create_transport", "host_bounce_for"]

"""Byte movers behind one interface (base.py).

Today: the embedded TCP transport (``tcp.py``), which copies device to device through CUDA IPC
(``cuda_ipc.py``) when P and D share a host and both keep KV on CUDA devices.
"""

from vllm_layerkv.blockio import BlockIO
from vllm_layerkv.config import TRANSPORTS
from vllm_layerkv.transport.base import ReceiveSink, SendChannel, Transport, TransportError


def create_transport(name: str, blocks: BlockIO) -> Transport:
    """The transport for setting ``transport``:

    * ``tcp``: bytes over TCP (zero-copy on CPU, a pinned staging buffer on GPU);
    * ``auto``: like ``tcp``, but same-host peers on CUDA copy device to device;
    * ``cuda_ipc``: device to device or nothing (a peer that cannot be mapped fails the
      transfer with the reason).
    """
    if name not in TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; use one of {list(TRANSPORTS)}")
    from vllm_layerkv.transport.tcp import TcpTransport

    device_blocks = getattr(blocks, "device_blocks", None)
    if name == "tcp":
        return TcpTransport()
    if device_blocks is None:
        if name == "cuda_ipc":
            raise TransportError(
                "transport=cuda_ipc needs the KV cache on a CUDA device, but this worker's KV "
                "is in host memory; use transport=auto or tcp")
        return TcpTransport()
    from vllm_layerkv.transport.cuda_ipc import DirectPeering

    return TcpTransport(DirectPeering(device_blocks, required=name == "cuda_ipc"))


__all__ = ["TRANSPORTS", "ReceiveSink", "SendChannel", "Transport", "TransportError",
           "create_transport"]

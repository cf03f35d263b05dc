"""Byte movers behind one interface (base.py). Only the embedded TCP transport ships today."""

from vllm_layerkv.transport.base import ReceiveSink, SendChannel, Transport, TransportError


def create_transport(name: str) -> Transport:
    """The transport for setting ``transport`` (``auto`` picks the best one available)."""
    if name in ("auto", "tcp"):
        from vllm_layerkv.transport.tcp import TcpTransport

        return TcpTransport()
    raise TransportError(f"unknown transport {name!r}")


__all__ = ["ReceiveSink", "SendChannel", "Transport", "TransportError", "create_transport"]

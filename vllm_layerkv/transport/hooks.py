"""One hook point per connection end, for tests that drive real servers into failures a network
or a device produces rarely. The default does nothing.

Each end of a LayerKV connection (P's ``TcpSendChannel``, D's reader of one connection) holds
a ``ConnectionHook``, made when the connection opens by the factory its transport chose once,
at construction (``TcpTransport``): ``ConnectionHook`` itself, unless the environment names
a test hook (``TEST_HOOK_ENV``; ``vllm_layerkv.testing.faults`` implements it).
"""

from __future__ import annotations

from vllm_layerkv.wire.protocol import TransferAbort, TransferAck, TransferDone, TransferNearlyDone

TEST_HOOK_ENV = "LAYERKV_TEST_FAULTS"
"""Set to "1" in a process's environment, its transports give each connection the test hook
of ``vllm_layerkv.testing.faults``; unset, the default hook. Never set in production."""

TransferMessage = TransferNearlyDone | TransferDone | TransferAbort | TransferAck
"""The per-transfer messages a connection end sends: P's hint, end and abort, D's ack."""


class ConnectionHook:
    """What one connection end does at its hook points: nothing."""

    def before_write(self, transfer_id: str) -> None:
        """P, before each write of ``transfer_id`` (whole blocks or head slices), on the sender
        thread. Raising ``TransportError`` fails the write as a broken link would."""

    def sends(self, msg: TransferMessage) -> bool:
        """Before each per-transfer message this end sends (P: ``TransferNearlyDone``,
        ``TransferDone``, ``TransferAbort``; D: ``TransferAck``): False drops it, unsent."""
        return True

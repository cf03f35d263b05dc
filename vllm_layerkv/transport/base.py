"""The transport interface: what LayerKV needs from a byte mover.

P side: a ``SendChannel`` per decode rank, opened with a handshake (``Hello``: the compatibility
check) and then used by exactly one thread, the sender, to write whole KV blocks of a set of
layers into the decode instance's blocks, followed by ``TransferDone`` or ``TransferAbort``.
Acknowledgements arrive asynchronously through a callback.

D side: the transport writes incoming blocks straight into KV memory. It asks a ``ReceiveSink``
(the decode worker's bookkeeping) before every write whether the transfer is still wanted and
whether the blocks belong to it, so a transfer that was aborted or timed out can never write into
blocks vLLM already gave to another request. Every call names its ``Source``, the connection it
came in on, so that only the connection a transfer is bound to can write into it, complete it or
abort it.

Both ends authenticate each connection before any message (``wire/auth.py``).

Stream transports reach KV memory through a ``BlockIO`` (blockio.py: zero-copy on CPU, a pinned
staging buffer on GPU). A transport that moves device memory itself (NIXL, Mooncake, CUDA IPC)
implements the same calls on registered regions instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.wire.protocol import Hello, TransferAck


class TransportError(RuntimeError):
    """A transfer could not be carried out (peer unreachable, refused, connection lost)."""


class Source(NamedTuple):
    """Who sent a data message: P's engine id, TP rank and TP size as the connection's
    ``Hello`` said, and the connection (``link``, unique per connection in this process)."""

    engine_id: str
    tp_rank: int
    tp_size: int
    link: int


@dataclass
class PendingWrite:
    """A head-slice write ``SendChannel.start_slices`` started; ``finish_slices`` ends it."""

    transfer_id: str
    nbytes: int
    """Bytes the write moves (0: nothing goes, e.g. D had already closed the transfer)."""
    handle: Any = None
    """The channel's state of a write still in flight; None once it is complete."""


class SendChannel(ABC):
    """P worker -> one D worker. Not thread-safe: one sender thread owns it."""

    @abstractmethod
    def write_blocks(
        self,
        transfer_id: str,
        layers: Sequence[int],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> int:
        """Copy every listed layer's ``src_blocks`` into the peer's ``dst_blocks``; returns
        bytes moved. Blocks until the source memory may be reused."""

    def write_slices(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], src_head: int, dst_head: int, num_heads: int,
                     staging: torch.Tensor) -> int:
        """Prefill and decode with different TP (``tp.py``): gather heads ``[src_head,
        src_head + num_heads)`` of every listed layer's ``src_blocks`` into ``staging`` (a
        buffer of the caller's, on the KV's device), move them in one transfer, and have the
        peer scatter them into heads ``[dst_head, ...)`` of its ``dst_blocks``. Returns bytes
        moved; blocks until ``staging`` may be reused."""
        raise TransportError(f"{type(self).__name__} cannot send head slices")

    def start_slices(self, transfer_id: str, layers: Sequence[int], src_blocks: Sequence[int],
                     dst_blocks: Sequence[int], src_head: int, dst_head: int, num_heads: int,
                     staging: torch.Tensor, make_room: Callable[[], bool] | None = None
                     ) -> PendingWrite:
        """``write_slices`` in two halves, so that a sender can keep several writes in flight
        (``writes_in_flight``): this one starts the write and may return before the bytes
        arrive; ``finish_slices`` waits for them. ``staging`` stays the caller's, untouched,
        until ``finish_slices`` returned. Writes finish in the order they started.
        ``make_room``: the caller's writes in flight may hold what this one waits for (a slot
        of D's ring); while it waits the channel calls ``make_room``, which finishes the
        caller's oldest write and returns True, or False when it has none. Default: the whole
        write, now."""
        return PendingWrite(transfer_id, self.write_slices(
            transfer_id, layers, src_blocks, dst_blocks, src_head, dst_head, num_heads,
            staging))

    def finish_slices(self, pending: PendingWrite) -> int:
        """Wait until the write ``start_slices`` started is in the peer's memory and reported
        to it; returns bytes moved (raises TransportError when the write failed)."""
        return pending.nbytes

    def slices_landed(self, pending: PendingWrite) -> bool:
        """Whether ``finish_slices`` would return without waiting for the wire or the device
        (the write is complete, or failed). Never blocks."""
        return pending.handle is None

    @property
    def bounces(self) -> bool:
        """Whole blocks, too, go through ``write_slices`` (with every head): the channel moves
        them through pinned host memory (``host_bounce``)."""
        return False

    @property
    def streams(self) -> int:
        """TCP connections this channel's byte payloads are dealt over (``tcp_streams``); 1
        for a channel that sends no bytes."""
        return 1

    @abstractmethod
    def send_nearly_done(self, transfer_id: str, tp_rank: int, eta_s: float) -> None:
        """Hint (``TransferNearlyDone``): only the last layer group is still to come, in about
        ``eta_s`` seconds. Ordered with the writes; it completes nothing."""

    @abstractmethod
    def send_done(self, transfer_id: str, tp_rank: int, frames: int, nbytes: int) -> None: ...

    @abstractmethod
    def send_abort(self, transfer_id: str, reason: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def alive(self) -> bool: ...


class ReceiveSink(Protocol):
    """Decode-worker bookkeeping the receiving side of a transport reports to."""

    @property
    def tp_rank(self) -> int:
        """This decode worker's TP rank (answered in ``HelloAck``)."""

    @property
    def tp_size(self) -> int:
        """This decode worker's TP size: a sender with another one writes head slices, for
        which a direct plane offers a receive ring."""

    def check_hello(self, hello: Hello) -> str | None:
        """None to accept a sender, else the refusal reason."""

    def begin_write(self, transfer_id: str, dst_blocks: Sequence[int], source: Source) -> bool:
        """True (and hold the transfer open) if ``source`` may write the blocks now."""

    def end_write(self, transfer_id: str, nbytes: int) -> None: ...

    def on_done(self, transfer_id: str, src_rank: int, src_tp: int, frames: int,
                nbytes: int, source: Source | None = None) -> TransferAck | None:
        """A source finished; returns the ack to send back once D is done with it."""

    def on_nearly_done(self, transfer_id: str, src_rank: int, eta_s: float,
                       source: Source | None = None) -> None:
        """A source expects to finish in about ``eta_s`` seconds (a hint)."""

    def on_abort(self, transfer_id: str, reason: str, source: Source | None = None) -> None:
        """Fail the transfer (P gave up, or this side refused a write of ``source``'s)."""

    def on_source_lost(self, source: Source, reason: str) -> None:
        """``source``'s connection ended: fail the transfers it carried."""


class Transport(ABC):
    name: str

    @abstractmethod
    def open_channel(
        self,
        endpoint: str,
        hello: Hello,
        blocks: BlockIO,
        on_ack: Callable[[TransferAck], None],
        on_lost: Callable[[str], None],
        timeout: float,
        io_timeout: float,
    ) -> SendChannel:
        """Connect to a decode rank's data endpoint and pass its compatibility check (both
        within ``timeout``); a write that makes no progress for ``io_timeout`` fails."""

    @abstractmethod
    def start_receiver(
        self, host: str, port: int, sink: ReceiveSink, blocks: BlockIO, io_timeout: float,
    ) -> str:
        """Listen for senders; returns the endpoint (host:port) to publish."""

    @property
    def authenticated(self) -> bool:
        """Every connection proves the shared secret (``wire/auth.py``) before any message."""
        return False

    @property
    def host_bounce(self) -> bool:
        """Every send may go through staging buffers and D's ring in host memory (a plane
        with ``host_bounce``): the sender makes its staging buffers at start-up and hands
        them to ``prepare_staging``."""
        return False

    def prepare_staging(self, buffers: Sequence[torch.Tensor]) -> None:
        """P side, at start-up when ``host_bounce``: make the staging ``buffers`` valid write
        sources now (engine registrations, pinned host twins), not on the first request."""

    @abstractmethod
    def shutdown(self) -> None: ...

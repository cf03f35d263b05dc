"""Embedded TCP transport: plain sockets, no dependency, zero-copy on host memory.

P sends one ``BlockData`` header per (transfer, layer group), then the payload from the KV
memory through a ``BlockIO`` (on CPU: ``sendall`` on zero-copy views, one call per run of
adjacent blocks per layer). D reads the header, validates it against its bookkeeping and
``recv_into``s the payload straight into its own KV blocks (CPU) or a pinned buffer scattered
into them (GPU); on CPU there is no intermediate buffer on either side, so on loopback KV moves
at memory-copy-like rates. One TCP connection per (P rank, D rank) keeps every transfer's frames
in order, which is what makes re-sending a partially filled block on the next chunk correct; a
frame's payload may be dealt over further TCP streams of the connection (``tcp_streams.py``),
which keeps that order.

Direct-write planes (``direct.py``: CUDA IPC on one host, NIXL, Mooncake): P's ``Hello`` lists
the planes it can drive, D answers with an export for each it can serve to that sender, and P
attaches the first that works, in its order of preference, then writes into D's memory itself
instead of sending bytes. The connection then carries only control: before each write P asks
(``DirectWrite``) and D grants (``WriteGrant``) through the same ``ReceiveSink.begin_write`` a
byte frame passes, and the grant holds the transfer open on D until P reports the write
complete (``DirectWritten``). So D never reports a transfer, and vLLM never reuses its blocks,
while P may still be writing into them. When no plane works P sends bytes, unless the plane was
required (``transport`` named it), in which case the transfer fails with every plane's reason.
With ``cuda_ipc_reads`` D maps the KV P offers in its ``Hello`` instead, and copies each group
itself when P sends ``DirectRead``; its ``WriteGrant`` then comes once the blocks are in, under
the same ``begin_write`` / ``end_write`` bookkeeping.

Every connection starts with the authentication handshake (``wire/auth.py``) before P's
``Hello``: D's listener admits a connection through a ``Gate`` (allowlist, ``max_connections``,
``handshake_timeout_s``; ``wire/admission.py``) and reads nothing from a peer that has not
proved the shared secret, so its exports (IPC handles, NIXL metadata, Mooncake addresses) reach
authenticated peers only; after that, it reads no message longer than its type allows (the
listener's message limits: ``max_transfer_blocks`` sizes a ``BlockData`` / ``DirectWrite``).
Each message D reads names its ``Source`` (the connection's ``Hello`` and the connection
itself): the receive table lets a transfer be written, completed or aborted only by the
connection it is bound to. A ``TransferDone`` or ``TransferNearlyDone`` naming a rank other
than its connection's is a protocol error.

Threads: D runs one accept thread and one reader thread per connection; P runs one ack-reader
thread per connection (the sender thread writes); each further TCP stream has one thread at
each end. Data sockets block, with ``io_timeout_s`` as the kernel's timeouts
(``framing.set_io_timeout``): a layer's payload is one send on P and one receive on D (per
stream), outside the GIL that the engine's thread holds while it steps; idle waits for the
next message poll. P's end of a connection is ``tcp_channel.TcpSendChannel``, which this module
opens; D's end is ``tcp_receiver.TcpReceiver``, which this module starts. Each end has a hook
(``hooks.py``), which does nothing unless the process's environment installs the test hook.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import msgspec
import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.kv.blockio import BlockIO
from vllm_layerkv.transport.base import ReceiveSink, SendChannel, Transport, TransportError
from vllm_layerkv.transport.direct import (
    DirectPlane,
    DirectUnavailable,
    PeerWriter,
    host_id,
)
from vllm_layerkv.transport.hooks import TEST_HOOK_ENV, ConnectionHook
from vllm_layerkv.transport.pacing import pacer_for
from vllm_layerkv.transport.tcp_channel import TcpSendChannel, WritePath
from vllm_layerkv.transport.tcp_receiver import RingShape, TcpReceiver
from vllm_layerkv.transport.tcp_streams import Streams
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import ListenerLimits
from vllm_layerkv.wire.auth import AuthError, ChannelAuth, connect_handshake
from vllm_layerkv.wire.protocol import (
    Hello,
    HelloAck,
    ProtocolError,
    Refused,
    StreamJoin,
    StreamJoinAck,
    TransferAck,
)

logger = init_logger(__name__)


def connection_hooks() -> Callable[[], ConnectionHook]:
    """What makes each connection end's hook (``hooks.py``): the test hook when the environment
    asks for it (``TEST_HOOK_ENV``), else the default, which does nothing."""
    if os.environ.get(TEST_HOOK_ENV) != "1":
        return ConnectionHook
    from vllm_layerkv.testing.faults import FaultHook

    return FaultHook


class TcpTransport(Transport):
    def __init__(self, planes: Sequence[DirectPlane] = (), required: str = "",
                 ring: RingShape = RingShape(), pacing_gbps: float = 0.0,
                 auth: ChannelAuth | None = None, limits: ListenerLimits | None = None,
                 streams: int = 1) -> None:
        """``auth``: the shared secret and allowlist of every connection (default: none);
        ``limits``: D's listener limits; ``streams``: ``tcp_streams``."""
        self._auth = auth or ChannelAuth()
        self._limits = limits or ListenerLimits()
        self._planes = list(planes)
        """Direct-write planes this worker can use, in order of preference."""
        self._required = required
        """The ``transport`` setting when it named a plane: no falling back to bytes."""
        self._ring_shape = ring
        self._streams = streams
        """TCP streams per connection for byte payloads (``tcp_streams.py``): P asks for this
        many, D accepts at most this many."""
        self._pacer = pacer_for(pacing_gbps)
        """P: paces this worker's byte payloads (``tcp_pacing_gbps``); None = off."""
        self._new_hook = connection_hooks()
        """Makes each connection end's hook; chosen once, here."""
        self.name = "+".join(["tcp", *(p.name for p in self._planes)])
        self.receiver: TcpReceiver | None = None
        """D: the data listener and its connections (``tcp_receiver.py``), once started."""

    @property
    def authenticated(self) -> bool:
        return self._auth.requires_secret

    @property
    def host_bounce(self) -> bool:
        return any(p.host_bounce for p in self._planes)

    # ------------------------------------------------------------------ P side
    def prepare_staging(self, buffers: Sequence[torch.Tensor]) -> None:
        for plane in self._planes:
            if plane.host_bounce:
                plane.prepare_staging(buffers)

    def open_channel(self, endpoint: str, hello: Hello, blocks: BlockIO,
                     on_ack: Callable[[TransferAck], None], on_lost: Callable[[str], None],
                     timeout: float, io_timeout: float) -> SendChannel:
        if self._planes:
            offered = [p.sender_export() for p in self._planes]
            hello = msgspec.structs.replace(hello, host_id=host_id(),
                                            direct=[p.name for p in self._planes],
                                            exports=[e for e in offered if e is not None])
        hello = msgspec.structs.replace(hello, streams=self._streams)
        try:
            sock = framing.connect(endpoint, timeout)
        except OSError as e:
            raise TransportError(f"cannot reach decode data endpoint {endpoint}: {e}") from None
        try:
            connect_handshake(sock, self._auth, timeout)
            framing.send_message(sock, hello)
            reply = framing.recv_message(sock, HelloAck, Refused)
        except AuthError as e:
            sock.close()
            raise TransportError(f"decode data endpoint {endpoint} and this prefill instance "
                                 f"did not authenticate each other: {e}") from None
        except (OSError, framing.PeerClosed) as e:
            sock.close()
            raise TransportError(f"cannot reach decode data endpoint {endpoint}: {e}") from None
        if isinstance(reply, Refused):
            sock.close()
            raise TransportError(f"decode {endpoint} refused the connection: {reply.reason}")
        if not isinstance(reply, HelloAck):
            sock.close()
            raise TransportError(f"decode {endpoint} answered {type(reply).__name__} to Hello")
        try:
            path = WritePath(self._attach(endpoint, reply), self._required)
        except TransportError as e:
            path = WritePath(None, self._required, refusal=str(e))
            logger.error("LayerKV: %s", path.refusal)
        framing.set_io_timeout(sock, io_timeout)  # a D that stops reading fails the send
        send = framing.send_all if self._pacer is None else self._pacer.sendall
        streams = Streams(endpoint, send)
        if path.writer is None and not path.refusal and reply.streams > 1:
            self._join_streams(endpoint, reply, streams, timeout, io_timeout)
        return TcpSendChannel(sock, endpoint, blocks, on_ack, on_lost, path, io_timeout,
                              self._new_hook(), streams)

    def _join_streams(self, endpoint: str, reply: HelloAck, streams: Streams, timeout: float,
                      io_timeout: float) -> None:
        """Open the further TCP streams D granted, in order, until one fails (logged: the
        connection then deals its payloads over the streams that joined)."""
        for index in range(1, min(reply.streams, self._streams)):
            sock = None
            try:
                sock = framing.connect(endpoint, timeout)
                connect_handshake(sock, self._auth, timeout)
                framing.send_message(sock, StreamJoin(token=reply.stream_token, index=index))
                answer = framing.recv_message(sock, StreamJoinAck, Refused)
                if not isinstance(answer, StreamJoinAck) or answer.index != index:
                    why = answer.reason if isinstance(answer, Refused) else repr(answer)
                    raise TransportError(f"decode refused it: {why}")
                framing.set_io_timeout(sock, io_timeout)
                streams.start(index, sock)
            except (OSError, AuthError, framing.PeerClosed, ProtocolError, TransportError) as e:
                if sock is not None:
                    sock.close()
                logger.warning("LayerKV: TCP stream %d of %d to decode %s did not open (%s); "
                               "sending over %d", index + 1, reply.streams, endpoint, e, index)
                return
        logger.info("LayerKV: KV bytes to decode %s over %d TCP streams", endpoint,
                    streams.usable())

    def _attach(self, endpoint: str, reply: HelloAck) -> PeerWriter | None:
        """The first plane, in this worker's order, that reaches D's KV; None to send bytes."""
        if not self._planes:
            return None
        reasons = []
        for plane in self._planes:
            export = next((e for e in reply.exports
                           if type(e).__struct_config__.tag == plane.name), None)
            if export is None:
                reasons.append(f"{plane.name}: decode did not offer it")
                continue
            try:
                writer = plane.attach(export)
            except DirectUnavailable as e:
                reasons.append(f"{plane.name}: {e}")
                continue
            logger.info("LayerKV: %s decode %s directly via %s (%s)",
                        "KV read by" if writer.reads else "writing KV into", endpoint,
                        plane.name, writer.description)
            return writer
        why = "; ".join(reasons)
        if self._required:
            raise TransportError(
                f"transport={self._required}: cannot write into decode {endpoint}: {why}; use "
                "transport=auto or tcp")
        logger.info("LayerKV: sending KV to decode %s over TCP (%s)", endpoint, why)
        return None

    # ------------------------------------------------------------------ D side
    def start_receiver(self, host: str, port: int, sink: ReceiveSink, blocks: BlockIO,
                       io_timeout: float) -> str:
        self.receiver = TcpReceiver(self._planes, self._required, self._ring_shape,
                                    self._auth, self._limits, self._streams, self._new_hook)
        return self.receiver.start(host, port, sink, blocks, io_timeout)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
        for plane in self._planes:
            plane.shutdown()
        if self.receiver is not None:
            self.receiver.close_connections()

    @property
    def connections(self) -> int:
        """D: data connections (and streams) being served now."""
        return self.receiver.connections if self.receiver is not None else 0

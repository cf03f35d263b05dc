"""Control channel between schedulers: D registers its blocks with P, or cancels.

* ``RegistrationServer`` (P scheduler process): a listener thread plus one thread per D
  connection. A connection is served only after the authentication handshake
  (``wire/auth.py``; the allowlist, connection cap and handshake deadline are in
  ``wire/admission.py``). Each ``Register`` is checked at once (compatibility, TP) and
  answered; accepted ones are queued for the scheduler thread, which matches them to requests
  by ``transfer_id``. The first accepted registration of a transfer id stays in force until
  P's scheduler forgets the transfer: another one for the same id is refused (the same one
  again, D retrying on a fresh connection, gets the same answer), and a ``Cancel`` for it is
  taken only from the connection that registered it while that connection is up.
  ``push`` sends a ``FirstToken`` unasked on the connection that registered its transfer, from
  a thread of its own.
* ``RegistrationClient`` (D scheduler process): one thread that sends queued messages over
  persistent, authenticated connections (one per P endpoint), and one reader per connection
  that queues whatever P sends (answers, first tokens) for the scheduler thread.

None of them ever runs on the scheduler's own thread: a slow or dead peer cannot stall
scheduling.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import start_thread
from vllm_layerkv.scheduler.bootstrap import BootstrapError, resolve
from vllm_layerkv.scheduler.request_params import BootstrapAddress, PrefillAddress
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import Gate, ListenerLimits, Slot, keepalive
from vllm_layerkv.wire.auth import AuthError, ChannelAuth, connect_handshake
from vllm_layerkv.wire.protocol import (
    Cancel,
    FirstToken,
    Message,
    Refused,
    Register,
    RegisterAck,
)

logger = init_logger(__name__)


class _Link:
    """One D connection on P's side: the connection thread answers on it and the push thread
    sends first tokens on it, one message at a time."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.lock = threading.Lock()
        self.alive = True

    def send(self, msg: Message) -> None:
        with self.lock:
            framing.send_message(self.conn, msg)


@dataclass
class _Claim:
    """The registration in force for a transfer id, and the connection that made it."""

    link: _Link
    register: Register
    reply: RegisterAck | None = None
    """P's answer, once given (repeated to an identical registration)."""
    pushed: bool = False
    """Its first token has been handed to the push thread (sent once)."""


class RegistrationServer:
    def __init__(self, host: str, port: int,
                 on_register: Callable[[Register], RegisterAck | Refused],
                 on_cancel: Callable[[Cancel], None], auth: ChannelAuth | None = None,
                 limits: ListenerLimits | None = None):
        self._on_register = on_register
        self._on_cancel = on_cancel
        self._gate = Gate("registration server", host, auth or ChannelAuth(),
                          limits or ListenerLimits())
        self._server = framing.listen(host, port)
        self.endpoint = f"{host}:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        self._claims: dict[str, _Claim] = {}
        """transfer_id -> its registration in force, until P's scheduler forgets the
        transfer (``forget``)."""
        self._lock = threading.Lock()
        self._pushes: queue.SimpleQueue[tuple[_Link, FirstToken] | None] = queue.SimpleQueue()
        start_thread(self._accept_loop, "layerkv-registrar")
        start_thread(self._push_loop, "layerkv-registrar-push")

    @property
    def connections(self) -> int:
        """Connections being served now (admitted, not yet ended)."""
        return self._gate.active

    @property
    def authenticated_connections(self) -> int:
        """Connections being served now that completed the handshake."""
        return self._gate.authenticated

    def close(self) -> None:
        self._stop.set()
        self._pushes.put(None)
        self._server.close()

    def push(self, msg: FirstToken) -> None:
        """Send ``msg`` to the D that registered its transfer, once. The connection is taken
        now, so a ``forget`` right after cannot lose it; the sending happens on the push
        thread (never blocks the caller). Without a connection (gone, or D did not ask) the
        message is dropped: D's kv_wait_timeout_s then fails its request."""
        with self._lock:
            claim = self._claims.get(msg.transfer_id)
            link = None
            if claim is not None and claim.register.wants_first_token and not claim.pushed:
                claim.pushed = True
                link = claim.link
        if link is None:
            logger.warning("transfer %s: no decode connection to send its first token on",
                           msg.transfer_id)
            return
        self._pushes.put((link, msg))

    def forget(self, transfer_id: str) -> None:
        """P's scheduler is done with ``transfer_id``: a new registration may use it again."""
        with self._lock:
            self._claims.pop(transfer_id, None)

    def _push_loop(self) -> None:
        while True:
            entry = self._pushes.get()
            if entry is None:
                return
            link, msg = entry
            try:
                link.send(msg)
            except OSError as e:
                logger.warning("transfer %s: first token not sent: %s", msg.transfer_id, e)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._server.accept()
            except OSError:
                return
            slot = self._gate.admit(conn, addr)
            if slot is None:
                continue
            framing.tune(conn)
            start_thread(self._serve, f"layerkv-registrar-{addr[1]}", conn, addr, slot)

    def _serve(self, conn: socket.socket, addr: tuple, slot: Slot) -> None:
        link = _Link(conn)
        try:
            if not self._gate.authenticate(slot, addr):
                return
            keepalive(conn)
            # idle between messages is fine (wait_readable); a message that has started must
            # keep arriving (message_timeout_s per read)
            conn.settimeout(self._gate.limits.message_timeout_s)
            while not self._stop.is_set():
                if not framing.wait_readable(conn, 1.0):
                    continue
                msg = framing.recv_message(conn, Register, Cancel,
                                           limits=self._gate.limits.messages)
                if isinstance(msg, Register):
                    link.send(self._register(msg, link))
                elif isinstance(msg, Cancel):
                    self._cancel(msg, link)
                else:
                    link.send(Refused(transfer_id="", reason=f"unexpected {type(msg).__name__}"))
        except (framing.PeerClosed, OSError):
            pass
        except Exception:  # noqa: BLE001 - thread boundary: log, drop the connection
            logger.exception("LayerKV registration connection from %s failed", addr[0])
        finally:
            link.alive = False
            self._gate.release(slot)
            conn.close()

    def _register(self, msg: Register, link: _Link) -> RegisterAck | Refused:
        with self._lock:  # claimed before P's scheduler can see it (it may push at once)
            claim = self._claims.get(msg.transfer_id)
            fresh = claim is None
            if claim is None:
                claim = self._claims[msg.transfer_id] = _Claim(link, msg)
        if not fresh:
            return self._repeat(claim, msg, link)
        reply = self._on_register(msg)
        with self._lock:
            if isinstance(reply, RegisterAck):
                claim.reply = reply
            elif self._claims.get(msg.transfer_id) is claim:
                del self._claims[msg.transfer_id]
        return reply

    def _repeat(self, claim: _Claim, msg: Register, link: _Link) -> RegisterAck | Refused:
        """A second registration for a transfer id in force: the same one again (D retrying
        on a new connection after the first one broke) gets the same answer; any other is
        refused and the first stays."""
        with self._lock:
            if claim.register == msg and claim.reply is not None:
                if not claim.link.alive:
                    claim.link = link  # the first token goes where D now listens
                return claim.reply
        logger.warning("refusing a second registration for transfer %s: one is in force",
                       msg.transfer_id)
        return Refused(transfer_id=msg.transfer_id,
                       reason="this transfer_id is already registered by another decode "
                              "registration, which stays in force; mint a fresh transfer_id "
                              "per request")

    def _cancel(self, msg: Cancel, link: _Link) -> None:
        with self._lock:
            claim = self._claims.get(msg.transfer_id)
            foreign = claim is not None and claim.link is not link and claim.link.alive
        if foreign:
            logger.warning("ignoring Cancel of transfer %s from a connection other than the "
                           "one that registered it", msg.transfer_id)
            return
        self._on_cancel(msg)


class RegistrationClient:
    """Sends Register/Cancel to prefill schedulers; what P sends back (answers, first tokens)
    comes through ``replies``. A prefill instance named by its bootstrap endpoint is looked up
    there first, from this client's thread, and the answer is kept until a connection to it
    fails."""

    def __init__(self, connect_timeout: float, io_timeout: float,
                 auth: ChannelAuth | None = None):
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._auth = auth or ChannelAuth()
        self._outbox: queue.SimpleQueue[tuple[PrefillAddress, Message] | None] = (
            queue.SimpleQueue())
        self._resolved: dict[BootstrapAddress, str] = {}
        self.replies: queue.SimpleQueue[RegisterAck | Refused | FirstToken] = queue.SimpleQueue()
        self._conns: dict[str, tuple[socket.socket, queue.SimpleQueue]] = {}
        """endpoint -> (connection, the answers its reader hands to ``_exchange``)."""
        self._thread = start_thread(self._run, "layerkv-register-client")

    def send(self, address: PrefillAddress, msg: Message) -> None:
        self._outbox.put((address, msg))

    def close(self) -> None:
        self._outbox.put(None)

    def _run(self) -> None:
        while True:
            entry = self._outbox.get()
            if entry is None:
                break
            address, msg = entry
            try:
                endpoint = self._endpoint(address)
            except BootstrapError as e:
                self.replies.put(Refused(transfer_id=getattr(msg, "transfer_id", ""),
                                         reason=str(e)))
                continue
            try:
                reply = self._exchange(endpoint, msg)
            except (OSError, framing.PeerClosed, ValueError) as e:
                self._drop(endpoint)
                if isinstance(address, BootstrapAddress):
                    self._resolved.pop(address, None)  # P may have restarted elsewhere
                why = (f"the prefill instance at {endpoint} and this decode instance did not "
                       f"authenticate each other: {e}" if isinstance(e, AuthError)
                       else f"cannot reach the prefill instance at {endpoint}: {e}")
                reply = Refused(transfer_id=getattr(msg, "transfer_id", ""), reason=why)
            if reply is not None:
                self.replies.put(reply)  # type: ignore[arg-type]
        for endpoint in list(self._conns):
            self._drop(endpoint)

    def _endpoint(self, address: PrefillAddress) -> str:
        if not isinstance(address, BootstrapAddress):
            return address
        endpoint = self._resolved.get(address)
        if endpoint is None:
            endpoint = resolve(address.bootstrap_addr, address.engine_id, self._connect_timeout,
                               self._auth)
            self._resolved[address] = endpoint
        return endpoint

    def _exchange(self, endpoint: str, msg: Message) -> Message | None:
        for attempt in (0, 1):  # a cached connection may have gone stale: retry once fresh
            conn, answers = self._connection(endpoint)
            try:
                framing.send_message(conn, msg)
                if isinstance(msg, Cancel):
                    return None
                try:
                    answer = answers.get(timeout=self._io_timeout)
                except queue.Empty:
                    raise TimeoutError(f"no answer within io_timeout_s={self._io_timeout:.0f} "
                                       "s") from None
                if isinstance(answer, Exception):
                    raise answer
                return answer
            except (OSError, framing.PeerClosed):
                self._drop(endpoint)
                if attempt:
                    raise
        return None

    def _connection(self, endpoint: str) -> tuple[socket.socket, queue.SimpleQueue]:
        entry = self._conns.get(endpoint)
        if entry is None:
            conn = framing.connect(endpoint, self._connect_timeout)
            try:
                connect_handshake(conn, self._auth, self._connect_timeout)
            except BaseException:
                conn.close()
                raise
            conn.settimeout(None)  # the reader blocks; answers are awaited with io_timeout
            entry = (conn, queue.SimpleQueue())
            self._conns[endpoint] = entry
            start_thread(self._read, "layerkv-register-reader", endpoint, *entry)
        return entry

    def _read(self, endpoint: str, conn: socket.socket, answers: queue.SimpleQueue) -> None:
        """Everything P sends on one connection: first tokens go straight to the scheduler,
        answers to the exchange that waits for them. Ends when the connection closes."""
        try:
            while True:
                msg = framing.recv_message(conn, RegisterAck, Refused, FirstToken)
                if isinstance(msg, FirstToken):
                    self.replies.put(msg)
                else:
                    answers.put(msg)
        except OSError as e:  # framing.PeerClosed included
            answers.put(e)
        except Exception as e:  # noqa: BLE001 - thread boundary: the exchange reports it
            logger.exception("LayerKV registration connection to %s failed", endpoint)
            answers.put(OSError(f"undecodable answer: {e}"))

    def _drop(self, endpoint: str) -> None:
        entry = self._conns.pop(endpoint, None)
        if entry is not None:
            try:
                entry[0].shutdown(socket.SHUT_RDWR)  # wakes its reader
            except OSError:
                pass
            entry[0].close()

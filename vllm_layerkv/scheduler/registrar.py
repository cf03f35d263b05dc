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
  persistent, authenticated connections (one per P endpoint) and awaits their answers, and one
  reader per connection that queues whatever P sends (answers, first tokens) for the
  scheduler thread.

Connecting, authenticating, waiting for an answer and reading never run on the scheduler's own
thread: a slow or dead peer cannot stall scheduling. The one exception is the write of a
``Register`` on a connection that is already open: the scheduler thread writes it itself,
without blocking (``MSG_DONTWAIT``; anything it cannot write at once goes through the thread).
P holds the request's prefill until the registration is there, and handing it to the thread
first cost a wait for the GIL, which D's engine loop holds while it steps (on an H200 host the
registration reached P 0.41-0.55 ms after D's scheduler sent it, median per run; 0.17-0.26 ms
written this way). Such a write can overtake a message the thread is about to send, so answers are
matched to their messages by transfer id, not by order.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import ThreadGroup, start_thread
from vllm_layerkv.scheduler.bootstrap import BootstrapError, resolve
from vllm_layerkv.scheduler.request_params import BootstrapAddress, PrefillAddress
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import (Gate, ListenerLimits, Slot, close_listener,
                                          keepalive)
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
        self._threads = ThreadGroup()
        """The accept thread, the push thread and one thread per connection."""
        self._threads.start(self._accept_loop, "layerkv-registrar")
        self._threads.start(self._push_loop, "layerkv-registrar-push")

    @property
    def connections(self) -> int:
        """Connections being served now (admitted, not yet ended)."""
        return self._gate.active

    @property
    def authenticated_connections(self) -> int:
        """Connections being served now that completed the handshake."""
        return self._gate.authenticated

    def close(self) -> None:
        """Stop serving: no new connection, the open ones shut, and their threads ended."""
        self._stop.set()
        self._pushes.put(None)
        close_listener(self._server)
        self._gate.shut_all()
        running = self._threads.join()
        if running:
            logger.warning("LayerKV registration server: thread(s) still running after the "
                           "stop: %s", ", ".join(running))

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
        for conn, addr, slot in self._gate.accepted(self._server, self._stop):
            self._threads.start(self._serve, f"layerkv-registrar-{addr[1]}", conn, addr, slot)

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


@dataclass(eq=False)
class _PrefillConnection:
    """D's open connection to one P endpoint."""

    sock: socket.socket
    answers: queue.SimpleQueue
    """What its reader hands to ``_exchange``: P's answers, or the error that ended it."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held for every write: the thread's, and the scheduler thread's (``_send_now``)."""
    early: dict[str, Message] = field(default_factory=dict)
    """Answers read while the thread awaited another one (by transfer id)."""


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
        self._outbox: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self._resolved: dict[BootstrapAddress, str] = {}
        self.replies: queue.SimpleQueue[RegisterAck | Refused | FirstToken] = queue.SimpleQueue()
        self._conns: dict[str, _PrefillConnection] = {}
        self._thread = start_thread(self._run, "layerkv-register-client")

    def send(self, address: PrefillAddress, msg: Message) -> None:
        """Send ``msg``; its answer comes through ``replies``. A Register on an open connection
        is written at once, from the caller's thread (see the module docstring)."""
        sent_on = self._send_now(address, msg) if isinstance(msg, Register) else None
        self._outbox.put(_Outgoing(address, msg, sent_on))

    def close(self) -> None:
        self._outbox.put(None)

    def _send_now(self, address: PrefillAddress, msg: Message) -> _PrefillConnection | None:
        """Write ``msg`` on the open connection to ``address`` if that can be done at once,
        whole; returns the connection it went out on, or None (the thread sends it)."""
        endpoint = address if isinstance(address, str) else self._resolved.get(address)
        conn = self._conns.get(endpoint) if endpoint is not None else None
        if conn is None or not conn.lock.acquire(blocking=False):
            return None
        try:
            data = framing.encode(msg)
            try:
                written = conn.sock.send(data, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                return None  # broken: the thread finds out, reconnects and sends it
            if written == len(data):
                return conn
            if written:
                # part of a frame is out and P is not reading: the connection is useless now;
                # the thread reconnects and sends the message again
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            return None
        finally:
            conn.lock.release()

    def _run(self) -> None:
        while True:
            entry = self._outbox.get()
            if entry is None:
                break
            address, msg = entry.address, entry.msg
            try:
                endpoint = self._endpoint(address)
            except BootstrapError as e:
                self.replies.put(Refused(transfer_id=getattr(msg, "transfer_id", ""),
                                         reason=str(e)))
                continue
            try:
                reply = self._exchange(endpoint, msg, entry.sent_on)
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

    def _exchange(self, endpoint: str, msg: Message,
                  sent_on: _PrefillConnection | None) -> Message | None:
        """Send ``msg`` (unless the scheduler thread already wrote it on ``sent_on``, still
        the open connection) and await its answer."""
        for attempt in (0, 1):  # a cached connection may have gone stale: retry once fresh
            conn = self._connection(endpoint)
            try:
                if conn is not sent_on or attempt:
                    with conn.lock:
                        framing.send_message(conn.sock, msg)
                if isinstance(msg, Cancel):
                    return None
                return self._answer(conn, msg.transfer_id)  # type: ignore[attr-defined]
            except (OSError, framing.PeerClosed):
                self._drop(endpoint)
                if attempt:
                    raise
        return None

    def _answer(self, conn: _PrefillConnection, transfer_id: str) -> Message:
        """P's answer for ``transfer_id`` on ``conn``, within io_timeout. P answers in the order
        the messages reached it, which need not be the order they were queued in here."""
        if transfer_id in conn.early:
            return conn.early.pop(transfer_id)
        deadline = time.monotonic() + self._io_timeout
        while True:
            try:
                answer = conn.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no answer within io_timeout_s={self._io_timeout:.0f} "
                                   "s") from None
            if isinstance(answer, Exception):
                raise answer
            if answer.transfer_id == transfer_id:
                return answer
            conn.early[answer.transfer_id] = answer

    def _connection(self, endpoint: str) -> _PrefillConnection:
        conn = self._conns.get(endpoint)
        if conn is None:
            sock = framing.connect(endpoint, self._connect_timeout)
            try:
                connect_handshake(sock, self._auth, self._connect_timeout)
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)  # the reader blocks; answers are awaited with io_timeout
            conn = _PrefillConnection(sock, queue.SimpleQueue())
            self._conns[endpoint] = conn
            start_thread(self._read, "layerkv-register-reader", endpoint, conn.sock,
                         conn.answers)
        return conn

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
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader
            except OSError:
                pass
            conn.sock.close()


@dataclass(frozen=True)
class _Outgoing:
    """A message for the client's thread."""

    address: PrefillAddress
    msg: Message
    sent_on: _PrefillConnection | None
    """The connection the scheduler thread already wrote it on (None: not written)."""

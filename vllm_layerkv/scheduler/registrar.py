"""Control channel between schedulers: D registers its blocks with P, or cancels.

* ``RegistrationServer`` (P scheduler process): a listener thread plus one thread per D
  connection. Each ``Register`` is checked at once (compatibility, TP) and answered; accepted
  ones are queued for the scheduler thread, which matches them to requests by ``transfer_id``.
  ``push`` sends a ``FirstToken`` unasked on the connection that registered its transfer, from
  a thread of its own.
* ``RegistrationClient`` (D scheduler process): one thread that sends queued messages over
  persistent connections (one per P endpoint), and one reader per connection that queues
  whatever P sends (answers, first tokens) for the scheduler thread.

None of them ever runs on the scheduler's own thread: a slow or dead peer cannot stall
scheduling.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import start_thread
from vllm_layerkv.scheduler.bootstrap import BootstrapError, resolve
from vllm_layerkv.scheduler.request_params import BootstrapAddress, PrefillAddress
from vllm_layerkv.wire import framing
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

    def send(self, msg: Message) -> None:
        with self.lock:
            framing.send_message(self.conn, msg)


class RegistrationServer:
    def __init__(self, host: str, port: int,
                 on_register: Callable[[Register], RegisterAck | Refused],
                 on_cancel: Callable[[Cancel], None]):
        self._on_register = on_register
        self._on_cancel = on_cancel
        self._server = framing.listen(host, port)
        self.endpoint = f"{host}:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        self._routes: dict[str, _Link] = {}
        """transfer_id -> the connection that registered it, for transfers whose D wants the
        first token (until it is pushed or the transfer is forgotten)."""
        self._routes_lock = threading.Lock()
        self._pushes: queue.SimpleQueue[tuple[_Link, FirstToken] | None] = queue.SimpleQueue()
        start_thread(self._accept_loop, "layerkv-registrar")
        start_thread(self._push_loop, "layerkv-registrar-push")

    def close(self) -> None:
        self._stop.set()
        self._pushes.put(None)
        self._server.close()

    def push(self, msg: FirstToken) -> None:
        """Send ``msg`` to the D that registered its transfer, once. The connection is taken
        now, so a ``forget`` right after cannot lose it; the sending happens on the push
        thread (never blocks the caller). Without a connection (gone, or D did not ask) the
        message is dropped: D's kv_wait_timeout_s then fails its request."""
        with self._routes_lock:
            link = self._routes.pop(msg.transfer_id, None)
        if link is None:
            logger.warning("transfer %s: no decode connection to send its first token on",
                           msg.transfer_id)
            return
        self._pushes.put((link, msg))

    def forget(self, transfer_id: str) -> None:
        with self._routes_lock:
            self._routes.pop(transfer_id, None)

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
            framing.tune(conn)
            start_thread(self._serve, f"layerkv-registrar-{addr[1]}", conn, addr)

    def _serve(self, conn: socket.socket, addr: tuple) -> None:
        link = _Link(conn)
        try:
            while not self._stop.is_set():
                msg = framing.recv_message(conn)
                if isinstance(msg, Register):
                    if msg.wants_first_token:  # before P's scheduler can see the registration
                        with self._routes_lock:
                            self._routes[msg.transfer_id] = link
                    reply = self._on_register(msg)
                    if isinstance(reply, Refused):
                        self.forget(msg.transfer_id)
                    link.send(reply)
                elif isinstance(msg, Cancel):
                    self._on_cancel(msg)
                else:
                    link.send(Refused(transfer_id="", reason=f"unexpected {type(msg).__name__}"))
        except (framing.PeerClosed, OSError):
            pass
        except Exception:  # noqa: BLE001 - thread boundary: log, drop the connection
            logger.exception("LayerKV registration connection from %s failed", addr)
        finally:
            with self._routes_lock:
                for tid in [t for t, lk in self._routes.items() if lk is link]:
                    del self._routes[tid]
            conn.close()


class RegistrationClient:
    """Sends Register/Cancel to prefill schedulers; what P sends back (answers, first tokens)
    comes through ``replies``. A prefill instance named by its bootstrap endpoint is looked up
    there first, from this client's thread, and the answer is kept until a connection to it
    fails."""

    def __init__(self, connect_timeout: float, io_timeout: float):
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
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
                reply = Refused(transfer_id=getattr(msg, "transfer_id", ""),
                                reason=f"cannot reach the prefill instance at {endpoint}: {e}")
            if reply is not None:
                self.replies.put(reply)  # type: ignore[arg-type]
        for endpoint in list(self._conns):
            self._drop(endpoint)

    def _endpoint(self, address: PrefillAddress) -> str:
        if not isinstance(address, BootstrapAddress):
            return address
        endpoint = self._resolved.get(address)
        if endpoint is None:
            endpoint = resolve(address.bootstrap_addr, address.engine_id, self._connect_timeout)
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
                msg = framing.recv_message(conn)
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

"""Control channel between schedulers: D registers its blocks with P, or cancels.

* ``RegistrationServer`` (P scheduler process): a listener thread plus one thread per D
  connection. Each ``Register`` is checked at once (compatibility, TP) and answered; accepted
  ones are queued for the scheduler thread, which matches them to requests by ``transfer_id``.
* ``RegistrationClient`` (D scheduler process): one thread that sends queued messages over
  persistent connections (one per P endpoint) and queues the answers for the scheduler thread.

Neither ever runs on the scheduler's own thread: a slow or dead peer cannot stall scheduling.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

from vllm_layerkv.protocol import Cancel, Message, Refused, Register, RegisterAck
from vllm_layerkv.transport import framing

logger = logging.getLogger("vllm.layerkv.registrar")


class RegistrationServer:
    def __init__(self, host: str, port: int,
                 on_register: Callable[[Register], RegisterAck | Refused],
                 on_cancel: Callable[[Cancel], None]):
        self._on_register = on_register
        self._on_cancel = on_cancel
        self._server = framing.listen(host, port)
        self.endpoint = f"{host}:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept_loop, name="layerkv-registrar", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._server.accept()
            except OSError:
                return
            framing.tune(conn)
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"layerkv-registrar-{addr[1]}").start()

    def _serve(self, conn: socket.socket, addr: tuple) -> None:
        try:
            while not self._stop.is_set():
                msg = framing.recv_message(conn)
                if isinstance(msg, Register):
                    framing.send_message(conn, self._on_register(msg))
                elif isinstance(msg, Cancel):
                    self._on_cancel(msg)
                else:
                    framing.send_message(conn, Refused(
                        transfer_id="", reason=f"unexpected {type(msg).__name__}"))
        except (framing.PeerClosed, OSError):
            pass
        except Exception:  # noqa: BLE001 - thread boundary: log, drop the connection
            logger.exception("LayerKV registration connection from %s failed", addr)
        finally:
            conn.close()


class RegistrationClient:
    """Sends Register/Cancel to prefill schedulers; answers come back through ``replies``."""

    def __init__(self, connect_timeout: float, io_timeout: float):
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._outbox: queue.SimpleQueue[tuple[str, Message] | None] = queue.SimpleQueue()
        self.replies: queue.SimpleQueue[RegisterAck | Refused] = queue.SimpleQueue()
        self._conns: dict[str, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, name="layerkv-register-client",
                                        daemon=True)
        self._thread.start()

    def send(self, endpoint: str, msg: Message) -> None:
        self._outbox.put((endpoint, msg))

    def close(self) -> None:
        self._outbox.put(None)

    def _run(self) -> None:
        while True:
            entry = self._outbox.get()
            if entry is None:
                break
            endpoint, msg = entry
            try:
                reply = self._exchange(endpoint, msg)
            except (OSError, framing.PeerClosed, ValueError) as e:
                self._drop(endpoint)
                reply = Refused(transfer_id=getattr(msg, "transfer_id", ""),
                                reason=f"cannot reach the prefill instance at {endpoint}: {e}")
            if reply is not None:
                self.replies.put(reply)  # type: ignore[arg-type]
        for endpoint in list(self._conns):
            self._drop(endpoint)

    def _exchange(self, endpoint: str, msg: Message) -> Message | None:
        for attempt in (0, 1):  # a cached connection may have gone stale: retry once fresh
            conn = self._conns.get(endpoint)
            if conn is None:
                conn = framing.connect(endpoint, self._connect_timeout)
                conn.settimeout(self._io_timeout)
                self._conns[endpoint] = conn
            try:
                framing.send_message(conn, msg)
                if isinstance(msg, Cancel):
                    return None
                return framing.recv_message(conn)
            except (OSError, framing.PeerClosed):
                self._drop(endpoint)
                if attempt:
                    raise
        return None

    def _drop(self, endpoint: str) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

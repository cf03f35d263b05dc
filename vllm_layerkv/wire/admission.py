"""Who gets a thread on a LayerKV listener, and for how long.

Each listener (P's registration server, D's data listener, P's bootstrap endpoint) serves a
connection on a thread of its own. A ``Gate`` bounds them:

* the allowlist (``allowed_peers``) is checked at ``accept``, before anything is read;
* at most ``max_connections`` connections are served at once. When all are taken, a new
  connection closes the oldest one that has not authenticated yet (so a flood of silent
  connections cannot keep an honest peer out), and is refused when every one has
  authenticated. A connection closed that way still holds its thread until it notices, so a
  listener runs at most 2 x ``max_connections`` connection threads;
* a new connection has ``handshake_timeout_s`` to complete the authentication handshake
  (``auth.py``); authenticated control connections then get TCP keepalive, so a peer that
  vanished without closing is noticed instead of holding its thread forever.

Refusals are logged at most once per 10 s per listener, with a count, and never with the
secret.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm_layerkv.common.log import RateLimitedWarning, init_logger
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import AuthError, ChannelAuth, accept_handshake, warn_if_open
from vllm_layerkv.wire.protocol import LIMITS, MessageLimits

logger = init_logger(__name__)
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3


@dataclass(frozen=True)
class ListenerLimits:
    """The limits of one listener (``max_connections``, ``handshake_timeout_s``,
    ``message_timeout_s``, ``max_transfer_blocks`` in config.py)."""

    max_connections: int = 256
    handshake_timeout_s: float = 5.0
    """A new connection that has not completed the authentication handshake by then is
    closed."""
    message_timeout_s: float = 10.0
    """Once a control message has started to arrive, each read of the rest must return within
    this (P's registration server; the bootstrap endpoint's requests)."""
    messages: MessageLimits = LIMITS
    """The largest message of each type the listener reads (``max_transfer_blocks`` sizes a
    ``Register``, a ``BlockData`` and a ``DirectWrite``; ``protocol.MessageLimits``)."""

    @classmethod
    def from_config(cls, config: Any) -> ListenerLimits:
        return cls(max_connections=config.max_connections,
                   handshake_timeout_s=config.handshake_timeout_s,
                   message_timeout_s=config.message_timeout_s,
                   messages=MessageLimits(config.max_transfer_blocks))


class Slot:
    """One admitted connection."""

    __slots__ = ("authenticated", "conn", "evicted")

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.authenticated = False
        self.evicted = False


class Gate:
    """One listener's admission: allowlist and connection cap at ``accept`` (``admit``, never
    blocks), the handshake on the connection's own thread (``authenticate``), ``release``
    when the connection ends."""

    def __init__(self, name: str, host: str, auth: ChannelAuth, limits: ListenerLimits):
        self.name = name
        self.auth = auth
        self.limits = limits
        self._slots: list[Slot] = []
        """Admitted connections, oldest first (evicted ones until their thread ends)."""
        self._lock = threading.Lock()
        self._refusals = RateLimitedWarning(logger)
        warn_if_open(auth, host)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._slots)

    @property
    def authenticated(self) -> int:
        """Connections served now that completed the handshake."""
        with self._lock:
            return sum(1 for s in self._slots if s.authenticated and not s.evicted)

    def accepted(self, server: socket.socket, stop: threading.Event
                 ) -> Iterator[tuple[socket.socket, Any, Slot]]:
        """The connections ``server`` accepts and this gate admits, tuned for LayerKV's
        messages, until the server socket is shut (``close_listener``) or a connection
        arrives after ``stop`` was set (it is closed unserved). A listener's accept loop: each
        connection then gets a thread of its own."""
        while True:
            try:
                conn, addr = server.accept()
            except OSError:
                return
            if stop.is_set():
                conn.close()
                return
            slot = self.admit(conn, addr)
            if slot is None:
                continue
            framing.tune(conn)
            yield conn, addr, slot

    def shut_all(self) -> None:
        """Shut every admitted connection (a stop: their threads see the sockets end)."""
        with self._lock:
            conns = [s.conn for s in self._slots]
        for conn in conns:
            _shut(conn)

    def admit(self, conn: socket.socket, addr: Any) -> Slot | None:
        """A slot for a connection just accepted, or None (the connection is then closed)."""
        try:
            self.auth.check_peer(addr)
        except AuthError as e:
            self._refuse(conn, f"{e}")
            return None
        with self._lock:
            live = [s for s in self._slots if not s.evicted]
            slot: Slot | None = Slot(conn)
            if len(live) >= self.limits.max_connections:
                victim = next((s for s in live if not s.authenticated), None)
                if victim is None:
                    slot = None
                else:
                    victim.evicted = True
                    _shut(victim.conn)  # its thread sees the handshake fail and releases it
            if slot is not None:
                self._slots.append(slot)
        if slot is None:
            self._refuse(conn, f"{_host(addr)}: max_connections="
                               f"{self.limits.max_connections} authenticated connections are "
                               "open; raise max_connections if this many peers are expected")
        return slot

    def authenticate(self, slot: Slot, addr: Any) -> bool:
        """Run the handshake on ``slot``'s connection (the caller's thread); False if the peer
        was refused (logged; the caller closes the connection)."""
        try:
            accept_handshake(slot.conn, self.auth, self.limits.handshake_timeout_s)
        except (AuthError, OSError) as e:
            if not slot.evicted:
                self._refusals.warning("LayerKV %s refused a connection from %s: %s",
                                       self.name, _host(addr), e)
            return False
        with self._lock:
            slot.authenticated = not slot.evicted
        return slot.authenticated

    def release(self, slot: Slot) -> None:
        with self._lock:
            if slot in self._slots:
                self._slots.remove(slot)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self._refusals.warning("LayerKV %s refused a connection: %s", self.name, why)
        _shut(conn)
        conn.close()


def close_listener(server: socket.socket) -> None:
    """Close a listening socket so that a thread blocked in its ``accept`` returns: on Linux
    ``close`` alone leaves that thread waiting for the next connection; ``shutdown`` wakes
    it."""
    _shut(server)
    server.close()


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive: a peer gone without closing (host down, cable cut) is noticed after
    about KEEPALIVE_IDLE_S + KEEPALIVE_PROBES x KEEPALIVE_INTERVAL_S seconds of silence."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            opt = getattr(socket, name, None)
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    except OSError:
        pass  # best effort: the connection still works without it


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _host(addr: Any) -> str:
    return str(addr[0]) if isinstance(addr, tuple) else str(addr)

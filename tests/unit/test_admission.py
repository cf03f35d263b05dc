"""wire/admission.py: a listener's accept loop (``Gate.accepted``) hands on only the
connections its gate admits, tuned, and ends when the listener stops."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from vllm_layerkv.common.threads import start_thread
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import Gate, ListenerLimits, close_listener
from vllm_layerkv.wire.auth import ChannelAuth, connect_handshake, parse_peers


class Listener:
    """A listening socket whose accept loop runs on a thread, putting what ``accepted``
    yields on ``handed`` and None once the loop has ended."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.server = framing.listen("127.0.0.1", 0)
        self.endpoint = ("127.0.0.1", self.server.getsockname()[1])
        self.stop = threading.Event()
        self.handed: queue.Queue = queue.Queue()
        start_thread(self._loop, "test-accept")

    def _loop(self) -> None:
        for conn, addr, slot in self.gate.accepted(self.server, self.stop):
            self.handed.put((conn, addr, slot))
        self.handed.put(None)

    def close(self) -> None:
        self.stop.set()
        close_listener(self.server)


@pytest.fixture
def listen() -> Iterator:
    made: list[Listener] = []

    def make(allowed_peers: str = "", max_connections: int = 8) -> Listener:
        auth = ChannelAuth(allowed_peers=parse_peers(allowed_peers))
        gate = Gate("test listener", "127.0.0.1", auth,
                    ListenerLimits(max_connections=max_connections))
        made.append(Listener(gate))
        return made[-1]

    yield make
    for listener in made:
        listener.close()


def test_an_admitted_connection_is_handed_on_tuned_with_its_slot(listen) -> None:
    listener = listen()
    with socket.create_connection(listener.endpoint, timeout=5):
        conn, addr, slot = listener.handed.get(timeout=5)
        try:
            assert slot.conn is conn and addr[0] == "127.0.0.1"
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert listener.gate.active == 1
        finally:
            conn.close()


def test_a_refused_connection_is_closed_and_never_handed_on(listen) -> None:
    listener = listen(allowed_peers="10.9.8.7")  # not loopback: every test peer is refused
    with socket.create_connection(listener.endpoint, timeout=5) as peer:
        assert peer.recv(1) == b""  # the gate closed it
    assert listener.handed.empty() and listener.gate.active == 0


def test_a_connection_beyond_the_cap_is_refused_when_every_slot_has_authenticated(
        listen) -> None:
    listener = listen(max_connections=1)
    with socket.create_connection(listener.endpoint, timeout=5) as first:
        conn, addr, slot = listener.handed.get(timeout=5)
        client = start_thread(connect_handshake, "test-handshake", first, ChannelAuth(), 5.0)
        assert listener.gate.authenticate(slot, addr) is True
        client.join(timeout=5)
        with socket.create_connection(listener.endpoint, timeout=5) as second:
            assert second.recv(1) == b""
        assert listener.handed.empty()
        conn.close()


def test_closing_the_listener_ends_its_loop_at_once(listen) -> None:
    listener = listen()
    time.sleep(0.2)  # the thread is blocked in accept (closing before it gets there is easy)
    listener.close()  # no connection comes to wake it
    assert listener.handed.get(timeout=5) is None


def test_a_connection_that_arrives_after_the_stop_is_closed_unserved(listen) -> None:
    listener = listen()
    listener.stop.set()  # the socket still listens: the thread is in accept
    with socket.create_connection(listener.endpoint, timeout=5) as late:
        assert late.recv(1) == b""
    assert listener.handed.get(timeout=5) is None

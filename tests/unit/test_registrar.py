"""registrar.py: the schedulers' control channel. Answers come back to D through ``replies``;
P can also send a ``FirstToken`` unasked on the connection that registered the transfer, and D
reads it while it sends nothing itself."""

from __future__ import annotations

import queue
import socket
import time

import pytest
from kv_sides import compat

from vllm_layerkv.scheduler.registrar import RegistrationClient, RegistrationServer
from vllm_layerkv.wire.protocol import Cancel, FirstToken, Refused, Register, RegisterAck


def register(tid: str, wants_first_token: bool = True) -> Register:
    return Register(transfer_id=tid, engine_id="d", compat=compat(), tp_size=1,
                    data_endpoints=["127.0.0.1:1"], block_ids=[[1]], start_token=0,
                    num_tokens=8, wants_first_token=wants_first_token)


@pytest.fixture
def pd():
    """(P's server, what it received, D's client); P refuses transfer ids starting 'bad'."""
    got: queue.SimpleQueue = queue.SimpleQueue()

    def on_register(reg: Register) -> RegisterAck | Refused:
        got.put(reg)
        if reg.transfer_id.startswith("bad"):
            return Refused(transfer_id=reg.transfer_id, reason="no")
        return RegisterAck(transfer_id=reg.transfer_id, tp_size=1)

    server = RegistrationServer("127.0.0.1", 0, on_register, got.put)
    client = RegistrationClient(connect_timeout=2, io_timeout=2)
    yield server, got, client
    client.close()
    server.close()


def test_answer_then_first_token_on_an_idle_connection(pd) -> None:
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="t1", tp_size=1)
    server.push(FirstToken(transfer_id="t1", token_id=42))  # D sends nothing meanwhile
    assert client.replies.get(timeout=5) == FirstToken(transfer_id="t1", token_id=42)
    server.push(FirstToken(transfer_id="t1", token_id=43))  # sent once: the route is gone
    client.send(server.endpoint, register("t2"))
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="t2", tp_size=1)
    with pytest.raises(queue.Empty):
        client.replies.get(timeout=0.3)


def test_no_first_token_unless_asked_refused_or_forgotten(pd) -> None:
    server, got, client = pd
    client.send(server.endpoint, register("plain", wants_first_token=False))
    client.send(server.endpoint, register("bad1"))
    client.send(server.endpoint, register("gone"))
    assert [client.replies.get(timeout=5).transfer_id for _ in range(3)] == [
        "plain", "bad1", "gone"]
    server.forget("gone")
    for tid in ("plain", "bad1", "gone"):
        server.push(FirstToken(transfer_id=tid, token_id=1))
    client.send(server.endpoint, Cancel(transfer_id="plain", reason="x"))
    client.send(server.endpoint, register("last"))
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="last", tp_size=1)
    with pytest.raises(queue.Empty):
        client.replies.get(timeout=0.3)


def test_unreachable_prefill_is_refused_with_the_endpoint(pd) -> None:
    _, _, client = pd
    client.send("127.0.0.1:1", register("t1"))
    reply = client.replies.get(timeout=10)
    assert isinstance(reply, Refused) and "127.0.0.1:1" in reply.reason


def test_a_dropped_connection_is_reopened_for_the_next_registration(pd) -> None:
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5).transfer_id == "t1"
    (conn,) = client._conns.values()  # noqa: SLF001 - the cached connection, cut by hand
    conn.sock.close()
    client.send(server.endpoint, register("t2"))
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="t2", tp_size=1)


def test_a_registration_on_an_open_connection_goes_out_from_the_callers_thread(pd) -> None:
    """P holds the prefill until the registration is there, so D's scheduler writes it on an
    open connection itself rather than wait for the client's thread: here that thread is stuck
    in a handshake with a listener that never answers, and P still gets the registration at
    once; its answer comes once the thread is free."""
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5).transfer_id == "t1"
    assert got.get(timeout=1).transfer_id == "t1"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        host, port = silent.getsockname()
        client.send(f"{host}:{port}", Cancel(transfer_id="elsewhere", reason="x"))
        time.sleep(0.2)  # the thread is in the handshake now, for connect_timeout (2 s)
        start = time.monotonic()
        client.send(server.endpoint, register("t2"))
        assert got.get(timeout=1).transfer_id == "t2"
        assert time.monotonic() - start < 1.0
        with pytest.raises(queue.Empty):
            client.replies.get(timeout=0.2)  # the answer waits for the thread
    # the listener closes: the Cancel is refused (it never reached a P), then t2's answer
    assert isinstance(client.replies.get(timeout=5), Refused)
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="t2", tp_size=1)


def test_answers_are_matched_to_their_messages_by_transfer_id(pd) -> None:
    """A registration the scheduler thread wrote can overtake one the client's thread was about
    to send, and P answers in the order it read them."""
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5).transfer_id == "t1"
    (conn,) = client._conns.values()  # noqa: SLF001 - answers fed in by hand
    conn.answers.put(RegisterAck(transfer_id="later", tp_size=1))
    conn.answers.put(RegisterAck(transfer_id="first", tp_size=1))
    assert client._answer(conn, "first").transfer_id == "first"  # noqa: SLF001
    assert client._answer(conn, "later").transfer_id == "later"  # noqa: SLF001
    assert not conn.early


def test_a_pushed_token_survives_the_transfer_being_forgotten_right_after(pd) -> None:
    """P's scheduler forgets a transfer once its KV is acknowledged, which can come before the
    push thread has sent the token (seen end to end on 2 cores: D waited until its
    kv_wait_timeout_s)."""
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5).transfer_id == "t1"
    server.push(FirstToken(transfer_id="t1", token_id=42))
    server.forget("t1")
    assert client.replies.get(timeout=5) == FirstToken(transfer_id="t1", token_id=42)


def test_close_shuts_the_connections_and_returns_once_the_threads_have_ended(pd) -> None:
    """The server's connection threads poll their sockets once a second: a close that only set
    the stop left them running up to a second, into the process's exit (threads.py)."""
    server, got, client = pd
    client.send(server.endpoint, register("t1"))
    assert client.replies.get(timeout=5) == RegisterAck(transfer_id="t1", tp_size=1)
    threads = list(server._threads._threads)
    assert len(threads) == 3  # accept, push, one connection
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 0.5
    assert [t.name for t in threads if t.is_alive()] == []
    assert server.connections == 0

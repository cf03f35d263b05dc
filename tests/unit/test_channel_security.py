"""LayerKV's listeners attacked over real loopback sockets, as an outside peer would: P's
registration server and D's data listener run in this process with a shared secret, and each
attack runs beside an honest transfer or registration that must still complete. Where memory
is at stake, the process's resident size (VmRSS) must stay within a stated bound.

What each listener must hold (docs/security.md): no message is read from a peer that has not
proved the secret; a transfer is touched only by the connection it is bound to; a registration
in force is never replaced; connections, early registrations and closed-transfer records are
capped, and silent connections time out."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from kv_sides import (
    BLOCK_BYTES,
    NUM_LAYERS,
    DSide,
    PSide,
    assert_copied,
    assert_sentinel,
    compat,
    push,
    task,
)

from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.scheduler.registrar import RegistrationClient, RegistrationServer
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.admission import ListenerLimits
from vllm_layerkv.wire.auth import (
    ANSWER,
    GREETING,
    SECRET_ENV,
    VERDICT,
    AuthError,
    ChannelAuth,
    connect_handshake,
)
from vllm_layerkv.wire.protocol import (
    LIMITS,
    BlockData,
    Cancel,
    FirstToken,
    Hello,
    HelloAck,
    Refused,
    Register,
    RegisterAck,
    TransferAbort,
    TransferAck,
    TransferDone,
)

SECRET = "k3y-0f-th1s-P-and-D-pair-0123456789"
WRONG = "not-the-secret-of-this-pair-0123456"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)  # each test names its own


def make_config(tmp_path: Path, secret: str | None = SECRET, **kw) -> LayerKVConfig:
    """Settings with ``secret`` in a file of its own (None: no secret); small timeouts."""
    extra = {"handshake_timeout_s": 2.0, "connect_timeout_s": 2.0, **kw}
    if secret is not None:
        f = tmp_path / f"secret-{abs(hash(secret))}"
        f.write_text(secret + "\n")
        f.chmod(0o600)
        extra["auth_secret_file"] = str(f)
    return LayerKVConfig.from_extra_config(extra)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def hello(engine_id: str = "prefill-0", rank: int = 0) -> Hello:
    return Hello(compat=compat(), engine_id=engine_id, tp_rank=rank, tp_size=1)


def authenticated(endpoint: str, secret: str | None = SECRET, source: str | None = None
                  ) -> socket.socket:
    """A raw connection that passed the handshake (with ``secret``)."""
    host, port = framing.split_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=2.0,
                                    source_address=(source, 0) if source else None)
    try:
        connect_handshake(sock, ChannelAuth(secret.encode() if secret else None), 2.0)
    except BaseException:
        sock.close()
        raise
    return sock


def data_peer(d: DSide, engine_id: str = "prefill-0") -> socket.socket:
    """An authenticated peer on D's data port that passed D's Hello check."""
    sock = authenticated(d.endpoint)
    framing.send_message(sock, hello(engine_id))
    assert framing.recv_message(sock) == HelloAck(tp_rank=0)
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` (anything it sends first is
    read and ignored)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except OSError:
        return True
    return False


# ------------------------------------------------------------------------ the honest side


def honest_transfer(p: PSide, d: DSide, tid: str, src: tuple[int, int] = (5, 6),
                    dst: tuple[int, int] = (1, 2)) -> None:
    """A whole transfer P -> D that must complete, with D's blocks equal to P's."""
    req = f"r-{tid}"
    d.table.expect(RecvTask(req, tid, list(dst)))
    push(p, [task(tid, d, list(src), list(dst), req_id=req)])
    out = p.wait_state(tid, ["acked", "failed"])
    assert out.state == "acked", out.reason
    assert d.drain_until(lambda f, x: req in f or bool(x)) == ({req}, set())
    for layer in range(NUM_LAYERS):
        for s, t in zip(src, dst):
            assert d.block(layer, t) == p.block(layer, s)


def register(tid: str, engine_id: str = "decode-0", endpoint: str = "127.0.0.1:1",
             wants_first_token: bool = False) -> Register:
    return Register(transfer_id=tid, engine_id=engine_id, compat=compat(), tp_size=1,
                    data_endpoints=[endpoint], block_ids=[[1]], start_token=0, num_tokens=8,
                    wants_first_token=wants_first_token)


class Prefill:
    """P's real registration server; it accepts every registration and records it."""

    def __init__(self, config: LayerKVConfig):
        self.registered: queue.SimpleQueue[Register] = queue.SimpleQueue()
        self.cancelled: queue.SimpleQueue[Cancel] = queue.SimpleQueue()

        def on_register(reg: Register) -> RegisterAck:
            self.registered.put(reg)
            return RegisterAck(transfer_id=reg.transfer_id, tp_size=1)

        self.server = RegistrationServer("127.0.0.1", 0, on_register, self.cancelled.put,
                                         ChannelAuth.from_config(config),
                                         ListenerLimits.from_config(config))
        self.endpoint = self.server.endpoint


@pytest.fixture
def prefill() -> Iterator[Callable[[LayerKVConfig], Prefill]]:
    made: list[Prefill] = []

    def make(config: LayerKVConfig) -> Prefill:
        made.append(Prefill(config))
        return made[-1]

    yield make
    for p in made:
        p.server.close()


@pytest.fixture
def decode_client() -> Iterator[Callable[[LayerKVConfig], RegistrationClient]]:
    """D's registration client with a config's secret."""
    made: list[RegistrationClient] = []

    def make(config: LayerKVConfig) -> RegistrationClient:
        made.append(RegistrationClient(2.0, 2.0, ChannelAuth.from_config(config)))
        return made[-1]

    yield make
    for c in made:
        c.close()


def honest_registration(client: RegistrationClient, p: Prefill, tid: str) -> None:
    client.send(p.endpoint, register(tid))
    assert client.replies.get(timeout=10) == RegisterAck(transfer_id=tid, tp_size=1)


# ------------------------------------------------------------------------ who gets in


def test_wrong_or_missing_secret_is_refused_at_both_listeners(
        tmp_path, d_side, p_side, prefill, decode_client) -> None:
    """Peers with the wrong secret or none are refused by D's data port and P's registration
    port while an honest transfer and an honest registration go on beside them; a refused peer
    gets nothing more (no HelloAck, and with it none of D's exports)."""
    config = make_config(tmp_path)
    d, p, pre = d_side(config=config), p_side(config=config), prefill(config)
    outcomes: list[str] = []

    def attack() -> None:
        for _ in range(5):
            for endpoint in (d.endpoint, pre.endpoint):
                for secret, expected in ((WRONG, "secrets differ"),
                                         (None, "requires a LayerKV shared secret")):
                    try:
                        sock = authenticated(endpoint, secret)
                    except AuthError as e:
                        outcomes.append("refused" if expected in str(e) else str(e))
                        continue
                    sock.close()
                    outcomes.append("admitted")

    attacker = threading.Thread(target=attack)
    attacker.start()
    honest_transfer(p, d, "t-honest")
    honest_registration(decode_client(config), pre, "t-registered")
    attacker.join(30)
    assert outcomes == ["refused"] * 20
    # a peer that skips the handshake and sends Hello at once gets no answer but the close
    sock = socket.create_connection(framing.split_endpoint(d.endpoint), timeout=2)
    framing.send_message(sock, hello())
    assert sock.recv(GREETING.size, socket.MSG_WAITALL)[:8] == b"LKV-AUTH"
    assert closed_by_peer(sock)
    sock.close()
    assert pre.registered.get_nowait().transfer_id == "t-registered"
    assert pre.registered.empty()


def test_a_secret_on_one_side_only_fails_the_transfer_saying_so(tmp_path, d_side,
                                                                 p_side) -> None:
    d = d_side(config=make_config(tmp_path))
    unauthenticated_p = p_side(config=make_config(tmp_path, secret=None))
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(unauthenticated_p, [task("t", d, [5, 6], [1, 2], req_id="r")])
    out = unauthenticated_p.wait_state("t", ["acked", "failed"])
    assert out.state == "failed" and "set the same LayerKV shared secret on P and D" in \
        out.reason and "this side has none" in out.reason
    assert_sentinel(d)  # nothing written, and the transfer still waits for its real sender
    assert d.table.pending() == 1
    push(p_side(config=make_config(tmp_path)), [task("t", d, [5, 6], [1, 2], req_id="r")])
    assert d.drain_until(lambda f, x: bool(f or x)) == ({"r"}, set())
    # the other way round: D without a secret, P with one
    open_d = d_side(config=make_config(tmp_path, secret=None))
    p = p_side(config=make_config(tmp_path))
    open_d.table.expect(RecvTask("r2", "t2", [3]))
    push(p, [task("t2", open_d, [7], [3], req_id="r2")])
    out = p.wait_state("t2", ["acked", "failed"])
    assert out.state == "failed" and "the peer has none" in out.reason
    assert_sentinel(open_d)


def test_a_replayed_handshake_answer_is_refused_by_the_data_listener(tmp_path, d_side,
                                                                     p_side) -> None:
    config = make_config(tmp_path)
    d, p = d_side(config=config), p_side(config=config)
    # record an honest client's answer by relaying its handshake to D
    first = socket.create_connection(framing.split_endpoint(d.endpoint), timeout=2)
    greeting = first.recv(GREETING.size, socket.MSG_WAITALL)
    mine, theirs = socket.socketpair()
    client = threading.Thread(target=connect_handshake,
                              args=(theirs, ChannelAuth(SECRET.encode()), 2.0))
    client.start()
    mine.sendall(greeting)
    answer = mine.recv(ANSWER.size, socket.MSG_WAITALL)
    first.sendall(answer)
    verdict = first.recv(VERDICT.size, socket.MSG_WAITALL)
    assert VERDICT.unpack(verdict)[2] == 0
    mine.sendall(verdict)
    client.join(5)
    # the same answer on a new connection: D's nonce differs, the proof fails
    replay = socket.create_connection(framing.split_endpoint(d.endpoint), timeout=2)
    replay.recv(GREETING.size, socket.MSG_WAITALL)
    replay.sendall(answer)
    assert VERDICT.unpack(replay.recv(VERDICT.size, socket.MSG_WAITALL))[2] != 0
    framing.send_message(replay, hello())  # nothing after a refusal is read
    assert closed_by_peer(replay)
    honest_transfer(p, d, "t-honest")
    for s in (first, replay, mine, theirs):
        s.close()


def test_a_peer_that_is_not_layerkv_is_dropped(tmp_path, d_side, p_side, prefill,
                                               decode_client) -> None:
    config = make_config(tmp_path)
    d, p, pre = d_side(config=config), p_side(config=config), prefill(config)
    for endpoint in (d.endpoint, pre.endpoint):
        sock = socket.create_connection(framing.split_endpoint(endpoint), timeout=2)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
        assert closed_by_peer(sock)
        sock.close()
    honest_transfer(p, d, "t-honest")
    honest_registration(decode_client(config), pre, "t-registered")


def test_the_allowlist_refuses_other_addresses_at_accept(tmp_path, d_side, p_side, prefill,
                                                         decode_client) -> None:
    """Only 127.0.0.1 may connect; a peer on 127.0.0.2 (also loopback) is closed before
    anything is exchanged, even with the right secret."""
    config = make_config(tmp_path, allowed_peers="127.0.0.1/32")
    d, p, pre = d_side(config=config), p_side(config=config), prefill(config)
    for endpoint in (d.endpoint, pre.endpoint):
        with pytest.raises(AuthError, match="closed the connection|connection failed"):
            authenticated(endpoint, SECRET, source="127.0.0.2")
    honest_transfer(p, d, "t-honest")
    honest_registration(decode_client(config), pre, "t-registered")


# ------------------------------------------------------------------------ who may touch a transfer


def test_another_authenticated_connection_cannot_touch_a_bound_transfer(tmp_path, d_side,
                                                                        p_side) -> None:
    """The honest P's connection carries transfer t. A second authenticated connection that
    claims the same engine id and rank can neither write into t's blocks, nor complete it,
    nor abort it, nor fail it by hanging up; a TransferDone naming a rank other than its own
    drops it; an abort for a transfer D has not opened yet is not kept to fail it later."""
    config = make_config(tmp_path)
    d, p = d_side(config=config, unknown_wait_s=0.3), p_side(config=config)
    d.table.expect(RecvTask("r", "t", [1, 2]))
    push(p, [task("t", d, [5, 6], [1, 2], final=False, req_id="r")], groups=[(0, 1)])
    deadline = time.monotonic() + 10
    while d.block(1, 2) != p.block(1, 6):  # the honest P's first group landed: t is bound
        assert time.monotonic() < deadline
        time.sleep(0.01)

    forger = data_peer(d)
    framing.send_message(forger, BlockData(transfer_id="t", layers=[2], dst_blocks=[1],
                                           block_bytes=BLOCK_BYTES, nbytes=BLOCK_BYTES))
    forger.sendall(b"\x66" * BLOCK_BYTES)
    framing.send_message(forger, TransferDone(transfer_id="t", tp_rank=0, frames=9, nbytes=9))
    ack = framing.recv_message(forger)
    assert isinstance(ack, TransferAck) and not ack.ok
    framing.send_message(forger, TransferAbort(transfer_id="t", reason="forged"))
    framing.send_message(forger, TransferAbort(transfer_id="t-later", reason="forged early"))
    time.sleep(0.5)  # D waits unknown_wait_s for t-later, then drops the abort
    forger.close()  # losing the forger's connection fails nothing it did not carry
    other_rank = data_peer(d, engine_id="prefill-0")
    framing.send_message(other_rank, TransferDone(transfer_id="t", tp_rank=1, frames=0,
                                                  nbytes=0))
    assert closed_by_peer(other_rank)
    other_rank.close()

    time.sleep(0.2)
    assert d.table.pending() == 1 and d.table.drain() == (set(), set())
    assert d.block(2, 1) != b"\x66" * BLOCK_BYTES  # the forged write was dropped
    honest_transfer(p, d, "t-later", src=(7, 8), dst=(3, 4))  # opened after the forged abort
    push(p, [task("t", d, [5, 6], [1, 2], req_id="r")], groups=[(2, 3)])
    assert p.wait_state("t", ["acked", "failed"]).state == "acked"
    assert d.drain_until(lambda f, x: "r" in f or bool(x)) == ({"r"}, set())
    assert_copied(p, d, [(5, 1), (6, 2), (7, 3), (8, 4)])


def test_a_registration_in_force_is_never_replaced(tmp_path, prefill, decode_client) -> None:
    config = make_config(tmp_path)
    pre = prefill(config)
    first, second = decode_client(config), decode_client(config)
    mine = register("t", engine_id="decode-0", endpoint="127.0.0.1:7001",
                    wants_first_token=True)
    first.send(pre.endpoint, mine)
    assert first.replies.get(timeout=10) == RegisterAck(transfer_id="t", tp_size=1)
    # another D (or anyone with the secret who learnt the id) tries to take the transfer over
    second.send(pre.endpoint, register("t", engine_id="elsewhere", endpoint="10.9.9.9:7001",
                                       wants_first_token=True))
    refused = second.replies.get(timeout=10)
    assert isinstance(refused, Refused) and "already registered" in refused.reason
    # the same registration again (D retrying on a fresh connection) gets the same answer
    second.send(pre.endpoint, mine)
    assert second.replies.get(timeout=10) == RegisterAck(transfer_id="t", tp_size=1)
    assert pre.registered.get(timeout=1) == mine and pre.registered.empty()  # seen once
    # the first one stays in force: its first token goes to its connection, a Cancel from
    # another connection is ignored, its own Cancel is taken
    pre.server.push(FirstToken(transfer_id="t", token_id=42))
    assert first.replies.get(timeout=10) == FirstToken(transfer_id="t", token_id=42)
    second.send(pre.endpoint, Cancel(transfer_id="t", reason="forged"))
    first.send(pre.endpoint, Cancel(transfer_id="t", reason="decode request aborted"))
    assert pre.cancelled.get(timeout=10).reason == "decode request aborted"
    assert pre.cancelled.empty()
    with pytest.raises(queue.Empty):
        second.replies.get(timeout=0.2)
    pre.server.forget("t")  # P is done with it: the id may be registered afresh
    honest_registration(second, pre, "t")


# ------------------------------------------------------------------------ resource limits


def test_a_flood_of_silent_connections_does_not_keep_honest_peers_out(
        tmp_path, d_side, p_side, prefill, decode_client) -> None:
    """60 connections that never authenticate, against listeners capped at 4 connections
    each: the honest registration and transfer are served, each listener's connection
    threads stay within 2 x max_connections, and RSS grows by less than 8 MiB (a connection
    must not cost memory before it authenticates)."""
    config = make_config(tmp_path, max_connections=4, handshake_timeout_s=30.0)
    d, p, pre = d_side(config=config), p_side(config=config), prefill(config)
    threads, rss = threading.active_count(), rss_bytes()
    flood = [socket.create_connection(framing.split_endpoint(endpoint), timeout=2)
             for endpoint in (d.endpoint, pre.endpoint) for _ in range(30)]
    time.sleep(0.5)
    assert threading.active_count() - threads <= 2 * 2 * 4
    honest_registration(decode_client(config), pre, "t-registered")
    honest_transfer(p, d, "t-honest")
    assert pre.server.connections <= 4 and d.transport.connections <= 4
    # P's sender and ack reader, D's connection thread, the client's two threads
    assert threading.active_count() - threads <= 2 * 2 * 4 + 5
    assert rss_bytes() - rss < 8 * MiB
    for s in flood:
        s.close()


def test_authenticated_connections_beyond_the_cap_are_refused(tmp_path, prefill,
                                                              decode_client) -> None:
    config = make_config(tmp_path, max_connections=3)
    pre = prefill(config)
    held = [authenticated(pre.endpoint) for _ in range(3)]
    # the client's handshake ends a moment before P's thread marks the slot authenticated;
    # until then a new connection may still evict it
    deadline = time.monotonic() + 5
    while pre.server.authenticated_connections < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(AuthError):
        authenticated(pre.endpoint)  # closed at accept: every slot is authenticated
    held.pop().close()
    deadline = time.monotonic() + 5
    while pre.server.connections >= 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    honest_registration(decode_client(config), pre, "t-registered")
    for s in held:
        s.close()


def test_an_idle_unauthenticated_connection_is_closed_after_the_timeout(
        tmp_path, d_side, p_side, prefill, decode_client) -> None:
    config = make_config(tmp_path, handshake_timeout_s=0.3)
    d, p, pre = d_side(config=config), p_side(config=config), prefill(config)
    for endpoint in (d.endpoint, pre.endpoint):
        t = time.monotonic()
        sock = socket.create_connection(framing.split_endpoint(endpoint), timeout=5)
        assert closed_by_peer(sock)  # after the greeting, nothing but the close
        assert 0.25 <= time.monotonic() - t < 3
        sock.close()
    deadline = time.monotonic() + 5
    while pre.server.connections or d.transport.connections:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    honest_registration(decode_client(config), pre, "t-registered")
    honest_transfer(p, d, "t-honest")


def test_a_half_sent_registration_is_dropped_after_message_timeout_s(tmp_path, prefill,
                                                                     decode_client) -> None:
    config = make_config(tmp_path, message_timeout_s=0.3)
    pre = prefill(config)
    sock = authenticated(pre.endpoint)
    sock.sendall(b"\x00\x00\x10\x00" + b"\x81")  # a 4 KiB message, 1 byte of it sent
    t = time.monotonic()
    assert closed_by_peer(sock) and time.monotonic() - t < 3
    sock.close()
    honest_registration(decode_client(config), pre, "t-registered")


def test_max_transfer_blocks_bounds_what_both_listeners_read(
        tmp_path, d_side, p_side, prefill, decode_client, caplog) -> None:
    """Listeners at max_transfer_blocks=64 drop a connection whose Register (P's registration
    server) or BlockData header (D's data listener) is longer than that allows, before
    reading it, and log which setting to raise; honest registrations and transfers beside
    them are served. At the default, a 16K-token prompt's registration (16-token blocks,
    four KV cache groups) and the Register refused above are both taken."""
    caplog.set_level(logging.ERROR, logger="vllm.layerkv")
    small = make_config(tmp_path, max_transfer_blocks=64)
    assert ListenerLimits.from_config(small).messages.max_transfer_blocks == 64
    assert ListenerLimits.from_config(make_config(tmp_path)).messages == LIMITS
    d, p, pre = d_side(config=small), p_side(config=small), prefill(small)
    ids = [2**31 + i for i in range(20_000)]  # 5 B each: longer than 64 ids' allowance
    too_long = msgspec.structs.replace(register("t-long"), block_ids=[ids])

    sock = authenticated(pre.endpoint)
    framing.send_message(sock, too_long)
    assert closed_by_peer(sock)
    sock.close()
    framing.send_message(sock := data_peer(d), BlockData(
        transfer_id="t-long", layers=[0], dst_blocks=ids[:3000], block_bytes=BLOCK_BYTES,
        nbytes=3000 * BLOCK_BYTES))
    assert closed_by_peer(sock)
    sock.close()
    assert "registration connection from 127.0.0.1 failed" in caplog.text
    assert "data listener dropped the connection from 127.0.0.1" in caplog.text
    for names in ("Register / Cancel this",
                  "BlockData / DirectWrite / DirectRead / DirectWritten / "):
        assert f"B, the largest {names}" in caplog.text
    assert caplog.text.count("with at most max_transfer_blocks=64 block ids; if real "
                             "transfers carry more, raise max_transfer_blocks on this "
                             "instance") == 2
    honest_registration(decode_client(small), pre, "t-registered")
    honest_transfer(p, d, "t-honest")

    default = make_config(tmp_path)
    pre_default, client = prefill(default), decode_client(default)
    prompt = msgspec.structs.replace(register("t-16k"), num_tokens=16_384,
                                     block_ids=[ids[:16_384 // 16]] * 4)
    for reg in (prompt, too_long):
        client.send(pre_default.endpoint, reg)
        assert client.replies.get(timeout=10) == RegisterAck(transfer_id=reg.transfer_id,
                                                             tp_size=1)
        assert pre_default.registered.get(timeout=1) == reg


def test_closed_transfer_records_are_capped_and_expire(tmp_path, d_side, p_side) -> None:
    """An authenticated peer names 12,000 transfer ids D never heard of (each is remembered as
    closed so that its late frames are dropped at once): D keeps at most
    max_closed_transfers of them, RSS grows by less than 1 MiB (without the cap: about
    2.4 MiB), and the records expire."""
    config = make_config(tmp_path, max_closed_transfers=100, closed_transfer_ttl_s=1.0)
    d, p = d_side(config=config, unknown_wait_s=0.0001), p_side(config=config)
    peer = data_peer(d)
    batch = 500
    rss = 0
    for start in range(0, 12_500, batch):
        if start == batch:
            rss = rss_bytes()  # after one batch: buffers made once are not counted
        for i in range(start, start + batch):
            framing.send_message(peer, TransferDone(transfer_id=f"{i:06d}" + "x" * 200,
                                                    tp_rank=0, frames=0, nbytes=0))
        for _ in range(batch):
            assert not framing.recv_message(peer).ok  # type: ignore[union-attr]
        assert len(d.table._closed) <= 100  # noqa: SLF001 - the records under test
    assert rss_bytes() - rss < 1 * MiB
    honest_transfer(p, d, "t-honest")
    time.sleep(1.1)
    d.table.drain()  # the worker's every step expires records
    assert not d.table._closed  # noqa: SLF001
    peer.close()


def test_early_registrations_are_capped_and_expire(tmp_path, decode_client) -> None:
    """A real prefill scheduler (vLLM's, with LayerKV's connector) at max_early_registrations
    = 20: 300 registrations for requests it never received (4,000 block ids each) are refused
    past the 20th, saying which setting, and RSS grows by less than 16 MiB (all 300 held would
    take about 40 MiB). At the cap, the registration of a request P does serve is still
    taken; after early_registration_ttl_s the held ones are dropped, their D told, and the
    cap is free again."""
    from vllm_objects import Engine, create_request

    config = make_config(tmp_path)
    p = Engine.create("kv_producer", {
        "auth_secret_file": config.auth_secret_file, "max_early_registrations": 20,
        "early_registration_ttl_s": 1.0, "registration_wait_s": 0,
        "registration_timeout_s": 30})
    try:
        prefill = p.connector._scheduler._prefill  # noqa: SLF001 - the bookkeeping under test
        assert prefill is not None
        rp = create_request(40, {"do_remote_decode": True, "transfer_id": "honest"})
        p.scheduler.add_request(rp)
        p.run_until(lambda: rp.request_id in p.finished)  # holds its blocks for D
        endpoint, client = p.endpoint, decode_client(config)

        def registration(tid: str, blocks: int = 4) -> Register:
            return Register(transfer_id=tid, engine_id="decode-0", compat=prefill._compat,
                            tp_size=1, data_endpoints=["127.0.0.1:1"],
                            block_ids=[list(range(1, blocks + 1))], start_token=0,
                            num_tokens=40)

        rss = rss_bytes()
        replies = []
        for i in range(300):  # one at a time: this side holds none of them
            client.send(endpoint, registration(f"early-{i}", blocks=4000))
            replies.append(client.replies.get(timeout=10))
        p.step()
        assert rss_bytes() - rss < 16 * MiB
        refused = [r for r in replies if isinstance(r, Refused)]
        assert len(refused) == 280 and len(prefill._early_regs) == 20
        assert all("max_early_registrations=20" in r.reason for r in refused)
        client.send(endpoint, registration("honest"))
        assert client.replies.get(timeout=10) == RegisterAck(transfer_id="honest", tp_size=1)
        flushed = p.step().meta.flushes
        assert [t.transfer_id for t in flushed] == ["honest"]  # attached and sent at once

        time.sleep(1.1)
        aborts = p.step().meta.aborts
        assert sorted(tid for tid, _, _ in aborts) == sorted(f"early-{i}" for i in range(20))
        assert all("never reached the prefill instance" in why for _, why, _ in aborts)
        assert not prefill._early_regs
        client.send(endpoint, registration("after-expiry"))
        assert client.replies.get(timeout=10) == RegisterAck(transfer_id="after-expiry",
                                                             tp_size=1)
        p.run_until(p.idle)  # the honest transfer's decode is unreachable: P lets go of it
    finally:
        p.shutdown()

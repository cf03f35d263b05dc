"""wire/auth.py on its own: the handshake between two ends of a socket pair, the secret's
sources, the allowlist, the signed HTTP header, and that the secret never shows. (The real
listeners, attacked from outside, are in test_channel_security.py.)"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.wire.auth import (
    ANSWER,
    GREETING,
    SECRET_ENV,
    VERDICT,
    AuthError,
    ChannelAuth,
    RequestVerifier,
    SecretError,
    accept_handshake,
    connect_handshake,
    load_secret,
    parse_peers,
    sign_request,
)

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def handshake(server: ChannelAuth, client: ChannelAuth, timeout: float = 2.0
              ) -> tuple[BaseException | None, BaseException | None]:
    """Run both ends over a socket pair; (server's error, client's error)."""
    a, b = socket.socketpair()
    errors: dict[str, BaseException | None] = {"server": None, "client": None}

    def run(side: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[side] = e

    t = threading.Thread(target=run, args=("server", lambda: accept_handshake(a, server,
                                                                              timeout)))
    t.start()
    run("client", lambda: connect_handshake(b, client, timeout))
    if errors["client"] is not None:
        b.close()  # as a refused client does: the server's wait ends
    t.join(timeout + 2)
    a.close()
    b.close()
    return errors["server"], errors["client"]


# ------------------------------------------------------------------------ the handshake


def test_same_secret_admits_both_ends_and_the_socket_works_after() -> None:
    a, b = socket.socketpair()
    a.settimeout(7.0)
    t = threading.Thread(target=accept_handshake, args=(a, ChannelAuth(SECRET), 2.0))
    t.start()
    connect_handshake(b, ChannelAuth(SECRET), 2.0)
    t.join(5)
    assert a.gettimeout() == 7.0  # the caller's timeout is put back
    b.sendall(b"framed message")
    assert a.recv(100) == b"framed message"
    a.close()
    b.close()


def test_without_a_secret_on_either_side_the_handshake_still_runs() -> None:
    assert handshake(ChannelAuth(), ChannelAuth()) == (None, None)


def test_different_secrets_are_refused_on_both_ends() -> None:
    server, client = handshake(ChannelAuth(SECRET), ChannelAuth(OTHER))
    assert isinstance(server, AuthError) and "wrong" in str(server)
    assert isinstance(client, AuthError) and "secrets differ" in str(client)
    for e in (server, client):
        assert "auth_secret_file or LAYERKV_AUTH_SECRET" in str(e)


@pytest.mark.parametrize("server_auth,client_auth,server_says,client_says", [
    (ChannelAuth(SECRET), ChannelAuth(), "peer has no LayerKV shared secret",
     "peer requires a LayerKV shared secret and this side has none"),
    (ChannelAuth(), ChannelAuth(SECRET),
     "peer has a LayerKV shared secret and this side has none",
     "this side has a LayerKV shared secret and the peer has none"),
])
def test_a_secret_on_one_side_only_says_so(server_auth, client_auth, server_says,
                                           client_says) -> None:
    server, client = handshake(server_auth, client_auth)
    assert isinstance(server, AuthError) and server_says in str(server)
    assert isinstance(client, AuthError) and client_says in str(client)


def test_a_replayed_answer_is_refused() -> None:
    """A recorded answer is bound to the greeting's nonce: on a new connection it fails."""
    a, b = socket.socketpair()
    t = threading.Thread(target=accept_handshake, args=(a, ChannelAuth(SECRET), 2.0))
    t.start()
    greeting = b.recv(GREETING.size, socket.MSG_WAITALL)
    # the honest client's answer to that greeting, recorded on the way
    c, d = socket.socketpair()
    client = threading.Thread(target=lambda: pytest.raises(AuthError, connect_handshake, d,
                                                           ChannelAuth(SECRET), 2.0))
    client.start()
    c.sendall(greeting)
    answer = c.recv(ANSWER.size, socket.MSG_WAITALL)
    b.sendall(answer)
    verdict = b.recv(VERDICT.size, socket.MSG_WAITALL)
    assert VERDICT.unpack(verdict)[2] == 0  # the relayed original passes
    t.join(5)
    for s in (a, b, c):
        s.close()
    client.join(5)
    d.close()
    # replayed on a fresh connection
    a, b = socket.socketpair()
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(
        pytest.raises(AuthError, accept_handshake, a, ChannelAuth(SECRET), 2.0).value))
    t.start()
    b.recv(GREETING.size, socket.MSG_WAITALL)
    b.sendall(answer)
    assert VERDICT.unpack(b.recv(VERDICT.size, socket.MSG_WAITALL))[2] != 0
    t.join(5)
    assert "replayed" in str(errors[0])
    a.close()
    b.close()


def test_a_peer_that_is_not_layerkv_is_named_as_such() -> None:
    # a client that speaks something else (an HTTP request, an older LayerKV's framed Hello)
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: b.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" +
                                                  b"x" * ANSWER.size))
    t.start()
    with pytest.raises(AuthError, match="not a LayerKV peer"):
        accept_handshake(a, ChannelAuth(SECRET), 2.0)
    t.join(5)
    # a server that greets with something else
    c, d = socket.socketpair()
    c.sendall(b"HTTP/1.1 400 Bad Request\r\n" + b"y" * GREETING.size)
    with pytest.raises(AuthError, match="not a LayerKV endpoint"):
        connect_handshake(d, ChannelAuth(SECRET), 2.0)
    for s in (a, b, c, d):
        s.close()


def test_a_silent_peer_is_dropped_at_the_deadline() -> None:
    a, b = socket.socketpair()
    with pytest.raises(AuthError, match="did not send its answer .* in time"):
        accept_handshake(a, ChannelAuth(SECRET), 0.2)
    with pytest.raises(AuthError, match="did not send its greeting .* in time"):
        connect_handshake(a, ChannelAuth(SECRET), 0.2)  # nothing greets this end
    a.close()
    b.close()


def test_a_peer_that_hangs_up_is_not_a_crash() -> None:
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(AuthError, match="connection failed during the LayerKV handshake"):
        accept_handshake(a, ChannelAuth(SECRET), 1.0)
    a.close()


# ------------------------------------------------------------------------ the secret's sources


def test_secret_from_a_file_is_stripped(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"\n  " + SECRET + b"  \n")
    f.chmod(0o600)
    assert load_secret(str(f), {}) == SECRET
    assert load_secret("", {}) is None


def test_secret_from_the_environment() -> None:
    assert load_secret("", {SECRET_ENV: f" {SECRET.decode()}\n"}) == SECRET


@pytest.mark.parametrize("setup,match", [
    (lambda d: str(d / "missing"), "does not exist; create it"),
    (lambda d: (d / "empty").write_text("  \n") and str(d / "empty"), "is empty"),
    (lambda d: str(d), "cannot read auth_secret_file"),
    (lambda d: (d / "short").write_text("abc") and str(d / "short"), "too short"),
])
def test_unusable_secret_files_say_what_to_change(tmp_path: Path, setup, match) -> None:
    path = setup(tmp_path)
    with pytest.raises(SecretError, match=match):
        load_secret(path, {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_file_says_so(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    f.chmod(0)
    with pytest.raises(SecretError, match="make it a file readable"):
        load_secret(str(f), {})


def test_secret_twice_or_empty_in_the_environment_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    with pytest.raises(SecretError, match="set twice"):
        load_secret(str(f), {SECRET_ENV: SECRET.decode()})
    with pytest.raises(SecretError, match="set but empty"):
        load_secret("", {SECRET_ENV: " "})


def test_a_secret_file_others_can_read_is_warned_about_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "shared"
    f.write_bytes(SECRET)
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="vllm.layerkv.wire.auth"):
        load_secret(str(f), {})
        load_secret(str(f), {})
    warnings = [r for r in caplog.records if "chmod 600" in r.getMessage()]
    assert len(warnings) == 1 and "0o644" in warnings[0].getMessage()


def test_config_refuses_the_secret_in_extra_config_and_names_the_sources() -> None:
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({"auth_secret": SECRET.decode()})
    assert "auth_secret_file" in str(e.value) and SECRET_ENV in str(e.value)
    assert SECRET.decode() not in str(e.value)


def test_config_turns_secret_and_allowlist_problems_into_config_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="auth_secret_file=.*does not exist"):
        LayerKVConfig.from_extra_config({"auth_secret_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="allowed_peers: 'ten' is not an IP address"):
        LayerKVConfig.from_extra_config({"allowed_peers": "10.0.0.0/8, ten"})
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    config = LayerKVConfig.from_extra_config({"allowed_peers": "10.0.0.0/8"})
    assert ChannelAuth.from_config(config).secret == SECRET


@pytest.mark.parametrize("extra,match", [
    ({"max_connections": 0}, "max_connections=0 must be between 1 and 65536"),
    ({"handshake_timeout_s": 0}, "handshake_timeout_s must be > 0"),
    ({"message_timeout_s": -1}, "message_timeout_s must be > 0"),
    ({"max_early_registrations": 0}, "max_early_registrations=0 must be >= 1"),
    ({"early_registration_ttl_s": 0}, "early_registration_ttl_s must be > 0"),
    ({"max_closed_transfers": 0}, "max_closed_transfers=0 must be >= 1"),
    ({"closed_transfer_ttl_s": 0}, "closed_transfer_ttl_s must be > 0"),
])
def test_limits_are_validated(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LayerKVConfig.from_extra_config(extra)


def test_the_secret_never_shows_in_reprs_or_errors() -> None:
    auth = ChannelAuth(SECRET, parse_peers("10.0.0.0/8"))
    text = repr(auth) + str(auth)
    assert SECRET.decode() not in text and "secret=set" in text and "10.0.0.0/8" in text
    assert "secret=none" in repr(ChannelAuth())
    server, client = handshake(ChannelAuth(SECRET), ChannelAuth(OTHER))
    for e in (server, client):
        assert SECRET.decode() not in str(e) and OTHER.decode() not in str(e)


# ------------------------------------------------------------------------ the allowlist


def test_allowlist_admits_its_networks_only() -> None:
    auth = ChannelAuth(None, parse_peers("10.1.0.0/16, 192.168.7.7, fd00::/8"))
    for ok in ("10.1.2.3", ("192.168.7.7", 5000), "::ffff:10.1.0.9", ("fd00::1", 1, 0, 0)):
        auth.check_peer(ok)
    for bad in ("10.2.0.1", ("192.168.7.8", 5000), "fe80::1", "not-an-address"):
        with pytest.raises(AuthError, match="allowed_peers"):
            auth.check_peer(bad)
    ChannelAuth().check_peer("203.0.113.9")  # no allowlist: anyone


# ------------------------------------------------------------------------ signed HTTP


@pytest.fixture
def verifier() -> Iterator[RequestVerifier]:
    yield RequestVerifier(ChannelAuth(SECRET), window_s=60, max_nonces=4)


def header(auth: ChannelAuth, method: str = "POST", path: str = "/register",
           body: bytes = b"{}", now: float | None = None) -> str:
    return sign_request(auth, method, path, body, now)["Authorization"]


def test_a_signed_request_passes_once(verifier: RequestVerifier) -> None:
    h = header(ChannelAuth(SECRET))
    verifier.verify("POST", "/register", b"{}", h)
    with pytest.raises(AuthError, match="replays"):
        verifier.verify("POST", "/register", b"{}", h)


@pytest.mark.parametrize("change,match", [
    ({"body": b'{"x": 1}'}, "signature is wrong"),
    ({"path": "/query"}, "signature is wrong"),
    ({"method": "GET"}, "signature is wrong"),
])
def test_a_signature_covers_method_path_and_body(verifier: RequestVerifier, change: dict,
                                                 match: str) -> None:
    h = header(ChannelAuth(SECRET))
    request = {"method": "POST", "path": "/register", "body": b"{}", **change}
    with pytest.raises(AuthError, match=match):
        verifier.verify(request["method"], request["path"], request["body"], h)


def test_bad_signatures_are_refused(verifier: RequestVerifier) -> None:
    with pytest.raises(AuthError, match="no LayerKV signature"):
        verifier.verify("POST", "/register", b"{}", None)
    with pytest.raises(AuthError, match="not a LayerKV-HMAC-SHA256 signature"):
        verifier.verify("POST", "/register", b"{}", "Bearer x" * 100)
    with pytest.raises(AuthError, match="signature is wrong"):
        verifier.verify("POST", "/register", b"{}", header(ChannelAuth(OTHER)))
    with pytest.raises(AuthError, match="older than 60 s"):
        verifier.verify("POST", "/register", b"{}", header(ChannelAuth(SECRET), now=1000.0))
    assert sign_request(ChannelAuth(), "GET", "/query") == {}  # no secret: nothing to sign
    RequestVerifier(ChannelAuth()).verify("GET", "/query", b"", None)  # ... nor to check


def test_the_replay_cache_is_bounded(verifier: RequestVerifier) -> None:
    auth = ChannelAuth(SECRET)
    for _ in range(4):
        verifier.verify("POST", "/register", b"{}", header(auth))
    with pytest.raises(AuthError, match="too many signed requests"):
        verifier.verify("POST", "/register", b"{}", header(auth))
    # once the window has passed, the old nonces are dropped and new requests pass
    import time
    later = time.time() + 61
    verifier.verify("POST", "/register", b"{}", header(auth, now=later), now=later)


def test_an_open_listener_without_a_secret_warns_once_per_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm_layerkv.wire import auth

    monkeypatch.setattr(auth, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="vllm.layerkv.wire.auth"):
        auth.warn_if_open(ChannelAuth(), "127.0.0.1")  # loopback: nobody else can connect
        auth.warn_if_open(ChannelAuth(SECRET), "10.0.0.5")  # a secret: fine
        assert not caplog.records
        auth.warn_if_open(ChannelAuth(), "10.0.0.5")
        auth.warn_if_open(ChannelAuth(), "0.0.0.0")
    assert len(caplog.records) == 1
    assert "without a shared secret" in caplog.records[0].getMessage()

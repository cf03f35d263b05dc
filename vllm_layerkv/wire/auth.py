"""Authentication of LayerKV's channels: a shared secret that P and D prove to each other before
any LayerKV message, and an optional allowlist of peer addresses.

Every LayerKV TCP connection (D's registration client -> P's registration server, P's sender ->
D's data listener) opens with a fixed-size exchange of raw bytes, before any framing:

1. the server greets: magic, version, whether it requires the secret, a fresh 32-byte nonce;
2. the client answers: magic, version, whether it has a secret, a fresh nonce of its own and
   HMAC-SHA256(secret, client label | greeting | the answer's first fields);
3. the server checks that MAC with ``hmac.compare_digest`` and returns a verdict with its own
   proof, HMAC-SHA256(secret, server label | greeting | the whole answer).

Each MAC covers both nonces, so a recorded answer fails on any later connection (the server's
nonce differs), and the two directions use different labels, so one side's proof is never
valid as the other's. The client checks the server's proof before it sends anything: P never
sends KV, and D never sends a registration, to a peer that does not know the secret. Every read
has a fixed size and the whole exchange one deadline: nothing is allocated from a length a peer
chose, and a peer that says nothing is dropped.

Without a secret the exchange still runs (the greeting says "no secret"), so a secret set on
one side only fails with an error that says so instead of as a garbled frame.

The handshake authenticates the two ends when the connection opens; it does not encrypt or
sign the bytes that follow (docs/security.md says what the network must provide).

The bootstrap endpoint speaks HTTP: a request carries ``Authorization: LayerKV-HMAC-SHA256
t=<unix time>,n=<nonce>,s=<HMAC over method, path, body hash, time and nonce>``
(``sign_request``), and the server accepts each nonce once within a time window
(``RequestVerifier``).

The secret itself never appears in a repr, a log line, an exception or a metric.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from vllm_layerkv.common.log import init_logger

logger = init_logger(__name__)

SECRET_ENV = "LAYERKV_AUTH_SECRET"
"""The environment variable that may hold the shared secret itself."""
MIN_SECRET_BYTES = 16
FIX_SECRET = ("set the same LayerKV shared secret on P and D: auth_secret_file or "
              f"{SECRET_ENV}")

MAGIC = b"LKV-AUTH"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
GREETING = struct.Struct(f"!8sBB{NONCE_BYTES}s")
"""Server -> client: magic, version, requires a secret (0/1), server nonce."""
ANSWER_HEAD = struct.Struct(f"!8sBB{NONCE_BYTES}s")
"""Client -> server, first part: magic, version, has a secret (0/1), client nonce."""
ANSWER = struct.Struct(f"!8sBB{NONCE_BYTES}s{MAC_BYTES}s")
"""Client -> server: ``ANSWER_HEAD`` and the client's MAC (zeros without a secret)."""
VERDICT = struct.Struct(f"!8sBB{MAC_BYTES}s")
"""Server -> client: magic, version, status, the server's proof (zeros without a secret)."""
_CLIENT_LABEL = b"LayerKV channel v1: client proof\x00"
_SERVER_LABEL = b"LayerKV channel v1: server proof\x00"
_NO_MAC = bytes(MAC_BYTES)

_OK, _BAD_SECRET, _CLIENT_HAS_NO_SECRET, _SERVER_HAS_NO_SECRET, _OTHER_VERSION = range(5)
_VERDICTS = {
    _BAD_SECRET: "the peer refused this side's proof of the LayerKV shared secret: the two "
                 f"secrets differ; {FIX_SECRET}",
    _CLIENT_HAS_NO_SECRET: "the peer requires a LayerKV shared secret and this side has none; "
                           + FIX_SECRET,
    _SERVER_HAS_NO_SECRET: "this side has a LayerKV shared secret and the peer has none; "
                           + FIX_SECRET,
    _OTHER_VERSION: "the peer speaks another version of LayerKV's authentication handshake; "
                    "run the same LayerKV version on P and D",
}

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


class AuthError(ConnectionError):
    """A peer was not admitted (or did not admit this side); the message says what to change
    and never contains the secret."""


class SecretError(ValueError):
    """The shared secret's source is unusable; config.py turns this into a ConfigError."""


# ------------------------------------------------------------------ settings


@dataclass(frozen=True, repr=False)
class ChannelAuth:
    """Who may use a LayerKV channel: peers that prove ``secret`` (None: no proof asked), from
    an address in ``allowed_peers`` (empty: any address)."""

    secret: bytes | None = field(default=None, repr=False)
    allowed_peers: tuple[Network, ...] = ()

    def __repr__(self) -> str:
        peers = ",".join(str(n) for n in self.allowed_peers) or "any"
        return (f"ChannelAuth(secret={'set' if self.secret else 'none'}, "
                f"allowed_peers={peers})")

    @property
    def requires_secret(self) -> bool:
        return self.secret is not None

    @classmethod
    def from_config(cls, config: Any, environ: Mapping[str, str] | None = None) -> ChannelAuth:
        """From ``config.auth_secret_file`` / ``LAYERKV_AUTH_SECRET`` and
        ``config.allowed_peers`` (a ``LayerKVConfig``; raises SecretError / ValueError, which
        ``LayerKVConfig.validate`` has already turned into ConfigErrors for a loaded config)."""
        environ = os.environ if environ is None else environ
        return cls(secret=load_secret(config.auth_secret_file, environ),
                   allowed_peers=parse_peers(config.allowed_peers))

    def check_peer(self, address: Any) -> None:
        """Raise AuthError when an allowlist is set and ``address`` (an ``accept`` address or a
        host string) is outside it."""
        if not self.allowed_peers:
            return
        host = address[0] if isinstance(address, tuple) else address
        try:
            ip = ipaddress.ip_address(str(host).split("%", 1)[0])
        except ValueError:
            raise AuthError(f"connection from {host!r} refused: not an IP address, and "
                            "allowed_peers is set") from None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not any(ip.version == net.version and ip in net for net in self.allowed_peers):
            raise AuthError(f"connection from {ip} refused: not in allowed_peers; add its "
                            "network to allowed_peers on this instance if it is a LayerKV peer")

    def _mac(self, label: bytes, data: bytes) -> bytes:
        assert self.secret is not None
        return hmac.new(self.secret, label + data, hashlib.sha256).digest()


def load_secret(secret_file: str, environ: Mapping[str, str]) -> bytes | None:
    """The shared secret from ``secret_file`` or the environment variable ``SECRET_ENV``
    (whitespace around it stripped); None when neither is set."""
    from_env = environ.get(SECRET_ENV)
    if secret_file and from_env is not None:
        raise SecretError(f"the LayerKV shared secret is set twice (auth_secret_file and "
                          f"{SECRET_ENV}); set it in one place only")
    if from_env is not None:
        secret = from_env.strip().encode()
        if not secret:
            raise SecretError(f"{SECRET_ENV} is set but empty; put the shared secret in it "
                              "(e.g. the output of `openssl rand -hex 32`) or unset it")
        return _long_enough(secret, SECRET_ENV)
    if not secret_file:
        return None
    path = Path(secret_file)
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecretError(f"auth_secret_file={secret_file} does not exist; create it with the "
                          f"shared secret (`openssl rand -hex 32 > {secret_file}; chmod 600 "
                          f"{secret_file}`) or fix the path") from None
    except OSError as e:
        raise SecretError(f"cannot read auth_secret_file={secret_file} ({e.strerror or e}); "
                          "make it a file readable by the user that runs vLLM") from None
    secret = raw.strip()
    if not secret:
        raise SecretError(f"auth_secret_file={secret_file} is empty; write the shared secret "
                          "into it")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _warn_once(f"mode:{path.resolve()}",
                   "LayerKV: auth_secret_file=%s can be read by other users (mode %s); "
                   "`chmod 600 %s`", secret_file, oct(mode & 0o777), secret_file)
    return _long_enough(secret, f"auth_secret_file={secret_file}")


def _long_enough(secret: bytes, source: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the LayerKV shared secret in {source} is too short; use at least "
                          f"{MIN_SECRET_BYTES} characters (e.g. `openssl rand -hex 32`)")
    return secret


def parse_peers(text: str) -> tuple[Network, ...]:
    """``allowed_peers``: comma-separated addresses or CIDRs; empty = any."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"allowed_peers: {item!r} is not an IP address or CIDR (e.g. "
                             "10.0.0.0/8, 192.168.1.7, fd00::/8)") from None
    return tuple(networks)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, msg: str, *args: object) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)


def warn_if_open(auth: ChannelAuth, host: str) -> None:
    """Once per process: a listener on an address other hosts can reach, without a secret."""
    if auth.requires_secret or _is_loopback(host):
        return
    _warn_once("open", "LayerKV listens on %s without a shared secret: anyone who can reach "
               "its ports can register transfers and write into this instance's KV cache. "
               "Set auth_secret_file or %s (the same on P and D), and allowed_peers; "
               "docs/security.md", host, SECRET_ENV)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------ the TCP handshake


def accept_handshake(sock: socket.socket, auth: ChannelAuth, timeout: float) -> None:
    """Server side, right after ``accept`` and before reading any message: admit the peer or
    raise AuthError (``timeout`` bounds the whole exchange; the socket's own timeout is put
    back afterwards)."""
    deadline = time.monotonic() + timeout
    before = sock.gettimeout()
    try:
        greeting = GREETING.pack(MAGIC, VERSION, int(auth.requires_secret),
                                 secrets.token_bytes(NONCE_BYTES))
        _send(sock, greeting, deadline)
        answer = _recv(sock, ANSWER.size, deadline, "its answer")
        magic, version, has_secret, _, mac = ANSWER.unpack(answer)
        if magic != MAGIC:
            raise AuthError("the peer is not a LayerKV peer, or runs a LayerKV version without "
                            "the authentication handshake (it did not answer the greeting); "
                            "run the same LayerKV version on P and D")
        status = _OK
        if version != VERSION:
            status = _OTHER_VERSION
        elif auth.requires_secret and not has_secret:
            status = _CLIENT_HAS_NO_SECRET
        elif has_secret and not auth.requires_secret:
            status = _SERVER_HAS_NO_SECRET
        elif auth.requires_secret and not hmac.compare_digest(
                mac, auth._mac(_CLIENT_LABEL, greeting + answer[:ANSWER_HEAD.size])):
            status = _BAD_SECRET
        proof = auth._mac(_SERVER_LABEL, greeting + answer) if status == _OK and \
            auth.requires_secret else _NO_MAC
        _send_verdict(sock, status, proof, deadline)
        if status != _OK:
            raise AuthError(_server_view(status))
    finally:
        _restore(sock, before)


def connect_handshake(sock: socket.socket, auth: ChannelAuth, timeout: float) -> None:
    """Client side, right after connecting and before sending anything: prove the secret and
    check the server's proof, or raise AuthError."""
    deadline = time.monotonic() + timeout
    before = sock.gettimeout()
    try:
        greeting = _recv(sock, GREETING.size, deadline, "its greeting")
        magic, version, requires, _ = GREETING.unpack(greeting)
        if magic != MAGIC:
            raise AuthError("the peer is not a LayerKV endpoint (its greeting is not "
                            "LayerKV's), or runs a LayerKV version without the authentication "
                            "handshake; check the address and run the same LayerKV version on "
                            "P and D")
        if version != VERSION:
            raise AuthError(_VERDICTS[_OTHER_VERSION])
        head = ANSWER_HEAD.pack(MAGIC, VERSION, int(auth.requires_secret),
                                secrets.token_bytes(NONCE_BYTES))
        mac = auth._mac(_CLIENT_LABEL, greeting + head) if auth.requires_secret and requires \
            else _NO_MAC
        answer = head + mac
        _send(sock, answer, deadline)
        if requires and not auth.requires_secret:
            raise AuthError(_VERDICTS[_CLIENT_HAS_NO_SECRET])
        if auth.requires_secret and not requires:
            raise AuthError(_VERDICTS[_SERVER_HAS_NO_SECRET])
        magic, version, status, proof = VERDICT.unpack(
            _recv(sock, VERDICT.size, deadline, "its verdict"))
        if magic != MAGIC:
            raise AuthError("the peer answered the LayerKV handshake with something else; "
                            "check that the address is a LayerKV endpoint")
        if status != _OK:
            raise AuthError(_VERDICTS.get(status, f"the peer refused the handshake (status "
                                                  f"{status})"))
        if auth.requires_secret and not hmac.compare_digest(
                proof, auth._mac(_SERVER_LABEL, greeting + answer)):
            raise AuthError("the peer did not prove that it knows the LayerKV shared secret; "
                            "it is not the LayerKV instance expected, or its secret differs: "
                            + FIX_SECRET)
    finally:
        _restore(sock, before)


def _server_view(status: int) -> str:
    """The refusal as the server logs it."""
    if status == _CLIENT_HAS_NO_SECRET:
        return "the peer has no LayerKV shared secret and this side requires one; " + FIX_SECRET
    if status == _SERVER_HAS_NO_SECRET:
        return "the peer has a LayerKV shared secret and this side has none; " + FIX_SECRET
    if status == _BAD_SECRET:
        return ("the peer's proof of the LayerKV shared secret is wrong (the secrets differ, "
                "or the handshake was replayed); " + FIX_SECRET)
    return _VERDICTS[status]


def _send_verdict(sock: socket.socket, status: int, proof: bytes, deadline: float) -> None:
    try:
        _send(sock, VERDICT.pack(MAGIC, VERSION, status, proof), deadline)
    except OSError:
        if status == _OK:
            raise
        # the peer may have hung up already (it knew it would be refused): the refusal stands


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise AuthError("the LayerKV handshake timed out while sending") from None
    except OSError as e:
        raise AuthError(f"the connection failed during the LayerKV handshake ({e})") from None


def _recv(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_left(deadline))
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise AuthError(f"the peer did not send {what} of the LayerKV handshake in time"
                            ) from None
        except OSError as e:
            raise AuthError(f"the connection failed before the peer sent {what} of the "
                            f"LayerKV handshake ({e})") from None
        if k == 0:
            raise AuthError(f"the peer closed the connection before sending {what} of the "
                            "LayerKV handshake (its allowed_peers or max_connections may "
                            "refuse this host, or it is not a LayerKV endpoint)")
        got += k
    return bytes(buf)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise AuthError("the LayerKV handshake timed out")
    return left


def _restore(sock: socket.socket, timeout: float | None) -> None:
    try:
        sock.settimeout(timeout)
    except OSError:
        pass  # closed meanwhile


# ------------------------------------------------------------------ HTTP (bootstrap endpoint)

HTTP_SCHEME = "LayerKV-HMAC-SHA256"
_HTTP_LABEL = b"LayerKV bootstrap request v1\x00"
_HEADER = re.compile(rf"^{HTTP_SCHEME} t=(\d{{1,12}}),n=([0-9a-f]{{32}}),s=([0-9a-f]{{64}})$")
MAX_HEADER_CHARS = 256


def _request_mac(auth: ChannelAuth, method: str, path: str, body: bytes, t: int,
                 nonce: str) -> str:
    signed = "\n".join((method.upper(), path, hashlib.sha256(body).hexdigest(), str(t),
                        nonce)).encode()
    return auth._mac(_HTTP_LABEL, signed).hex()


def sign_request(auth: ChannelAuth, method: str, path: str, body: bytes = b"",
                 now: float | None = None) -> dict[str, str]:
    """The ``Authorization`` header for an HTTP request to a LayerKV bootstrap endpoint
    (none without a secret)."""
    if not auth.requires_secret:
        return {}
    t = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    mac = _request_mac(auth, method, path, body, t, nonce)
    return {"Authorization": f"{HTTP_SCHEME} t={t},n={nonce},s={mac}"}


class RequestVerifier:
    """Checks ``sign_request`` headers: the MAC, a timestamp within ``window_s`` of this host's
    clock, and a nonce not seen before. Seen nonces are kept for the window only (an older
    request fails on its timestamp), at most ``max_nonces`` of them."""

    def __init__(self, auth: ChannelAuth, window_s: float = 120.0, max_nonces: int = 65536):
        self._auth = auth
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        """nonce -> when it stops mattering (its timestamp + window), oldest first."""
        self._lock = threading.Lock()

    def verify(self, method: str, path: str, body: bytes, header: str | None,
               now: float | None = None) -> None:
        """Raise AuthError unless ``header`` signs this request (no-op without a secret)."""
        if not self._auth.requires_secret:
            return
        if not header:
            raise AuthError("the request carries no LayerKV signature (Authorization header); "
                            + FIX_SECRET)
        match = _HEADER.match(header[:MAX_HEADER_CHARS]) if len(header) <= MAX_HEADER_CHARS \
            else None
        if match is None:
            raise AuthError(f"the request's Authorization header is not a {HTTP_SCHEME} "
                            "signature; " + FIX_SECRET)
        t, nonce, mac = int(match[1]), match[2], match[3]
        now = time.time() if now is None else now
        if abs(now - t) > self._window_s:
            raise AuthError(f"the request's signature is older than {self._window_s:.0f} s or "
                            "from the future; keep the hosts' clocks in sync (NTP)")
        if not hmac.compare_digest(mac, _request_mac(self._auth, method, path, body, t, nonce)):
            raise AuthError("the request's LayerKV signature is wrong (the secrets differ); "
                            + FIX_SECRET)
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("the request replays an earlier signed request")
            if len(self._seen) >= self._max_nonces:
                raise AuthError("too many signed requests in the replay window; retry later")
            self._seen[nonce] = t + self._window_s

"""The proxy's backends: a prefill or decode instance's URL (with an optional LayerKV endpoint
given as ``#kv=HOST:PORT``), validated with errors that say what to change, and what the proxy
knows of each instance (its LayerKV endpoint, its requests in flight, whether it was reachable).
Picking one per request is routing.py's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vllm_layerkv.common.log import init_logger

logger = init_logger(__name__)

UNREACHABLE_BACKOFF_S = 5.0
"""After a request or health check could not reach an instance, the router passes it over for
this long (unless every instance of its role is passed over), then tries it again."""


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[v6]:PORT`` -> (host, port); ValueError naming ``what`` otherwise."""
    host, sep, port_s = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1-65535, got {text!r}")
    return host, int(port_s)


@dataclass
class Backend:
    """One vLLM OpenAI server (a prefill or a decode instance)."""

    url: str
    """Server root, e.g. ``http://10.0.0.5:8100`` (no trailing slash, no fragment)."""
    role: str
    """``"prefill"`` or ``"decode"``."""
    index: int = 0
    """Its place in its role's list (``--prefill`` / ``--decode`` order), from 0."""
    kv_endpoint: tuple[str, int] | None = None
    """Prefill only: the LayerKV endpoint D registers with (discovered or overridden)."""
    kv_override: bool = False
    """True when ``kv_endpoint`` came from the URL's ``#kv=HOST:PORT`` fragment."""
    discovery_error: str | None = None
    """Prefill only: why the last discovery of ``kv_endpoint`` failed, in full, with URLs (None
    after a success); the proxy's log and its detailed ``/health`` show it."""
    discovery_failure: str | None = None
    """The same without URLs or backend answers: what clients and the open ``/health`` see."""
    discover_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    in_flight: int = 0
    """Requests routed here that this instance has not finished (its ``Router`` counts them)."""
    unreachable_until: float = 0.0
    """``time.monotonic()`` until which the router passes this instance over (0: reachable)."""

    def mark_unreachable(self, why: str) -> None:
        if not self.unreachable_until:
            logger.warning("%s is unreachable (%s); routing around it for %g s, then trying "
                           "it again", self, why, UNREACHABLE_BACKOFF_S)
        self.unreachable_until = time.monotonic() + UNREACHABLE_BACKOFF_S

    def mark_reachable(self) -> None:
        if self.unreachable_until:
            logger.info("%s is reachable again", self)
        self.unreachable_until = 0.0

    @property
    def name(self) -> str:
        """How answers to clients name this instance: role and number, never its URL."""
        return f"{self.role} instance {self.index}"

    def __str__(self) -> str:
        """How the proxy's log names this instance."""
        return f"{self.role} {self.url}"


def parse_backend_url(text: str, role: str, index: int = 0) -> Backend:
    """Validate a backend URL from the command line or ``build_app`` (``index``: its place in
    its role's list).

    Accepts ``http(s)://host:port`` (the server root). Prefill URLs may carry
    ``#kv=HOST:PORT`` to give the LayerKV endpoint explicitly. Raises ValueError with a message
    saying what to change.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    raw = text.strip()
    try:
        parts = urlsplit(raw)
        port = parts.port  # raises ValueError for a non-numeric / out-of-range port
    except ValueError as e:
        raise ValueError(f"invalid {role} URL {text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid {role} URL {text!r}: expected http://HOST:PORT "
                         f"(e.g. http://127.0.0.1:8100)")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"invalid {role} URL {text!r}: give the server root "
                         f"({parts.scheme}://{parts.netloc}), without a path such as /v1")
    if port is None:
        logger.warning("%s URL %s has no port; using the scheme's default", role, raw)
    backend = Backend(url=f"{parts.scheme}://{parts.netloc}", role=role, index=index)
    if parts.fragment:
        if role != "prefill":
            raise ValueError(f"invalid decode URL {text!r}: only prefill URLs take a "
                             f"'#kv=HOST:PORT' fragment")
        key, eq, value = parts.fragment.partition("=")
        if key != "kv" or not eq:
            raise ValueError(f"invalid prefill URL {text!r}: the fragment must be "
                             f"'#kv=HOST:PORT' (the instance's LayerKV endpoint)")
        backend.kv_endpoint = parse_hostport(value, f"the '#kv=' part of {text!r}")
        backend.kv_override = True
    return backend

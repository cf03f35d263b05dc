"""The proxy's backends: a prefill or decode instance's URL (with an optional LayerKV endpoint
given as ``#kv=HOST:PORT``), validated with errors that say what to change, and the router that
picks one per request and counts the requests each has in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Iterable
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
    kv_endpoint: tuple[str, int] | None = None
    """Prefill only: the LayerKV endpoint D registers with (discovered or overridden)."""
    kv_override: bool = False
    """True when ``kv_endpoint`` came from the URL's ``#kv=HOST:PORT`` fragment."""
    discovery_error: str | None = None
    """Prefill only: why the last discovery of ``kv_endpoint`` failed (None after a success)."""
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

    def __str__(self) -> str:
        return f"{self.role} {self.url}"


def parse_backend_url(text: str, role: str) -> Backend:
    """Validate a backend URL from the command line or ``build_app``.

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
    backend = Backend(url=f"{parts.scheme}://{parts.netloc}", role=role)
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


ROUTING_POLICIES = ("least-loaded", "round-robin")


class Lease:
    """One request's hold on a backend: ``release`` (idempotent) when the instance is done with
    it, e.g. P's answer arrived or D's stream ended."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.task: asyncio.Task[Any] | None = None
        """The request task this lease ends with (``end_with``), if any."""
        self._held = True
        backend.in_flight += 1

    def end_with(self, task: asyncio.Task[Any]) -> None:
        """Release when ``task`` (the request to this backend) ends, however it ends."""
        self.task = task
        task.add_done_callback(lambda _: self.release())

    def release(self) -> None:
        if self._held:
            self._held = False
            self.backend.in_flight -= 1


class Router:
    """Picks the backend of each request from one role's list.

    ``least-loaded`` (the default) takes a backend with the fewest requests in flight, and
    breaks ties in turn from where the last pick left off. An idle or evenly loaded list is
    therefore cycled exactly as ``round-robin`` would. When a long prompt keeps one prefill
    instance busy, new requests go to the others instead of queueing behind it. ``round-robin``
    takes the next backend in turn whatever its load.

    Both pass over a backend that was unreachable within ``UNREACHABLE_BACKOFF_S``, unless
    every backend is; then they choose among all (the request fails saying which instance is
    unreachable, rather than being refused by the proxy).

    Single-threaded (the event loop), so no lock is needed."""

    def __init__(self, backends: Iterable[Backend], policy: str = "least-loaded") -> None:
        self.items: list[Backend] = list(backends)
        if not self.items:
            raise ValueError("a router needs at least one backend")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self._next = 0

    def pick(self) -> Lease:
        n = len(self.items)
        now = time.monotonic()
        in_turn = [(self._next + k) % n for k in range(n)]
        in_turn = [i for i in in_turn if self.items[i].unreachable_until <= now] or in_turn
        if self.policy == "least-loaded":
            # min() keeps the first of equals: the one whose turn comes first
            chosen = min(in_turn, key=lambda i: self.items[i].in_flight)
        else:
            chosen = in_turn[0]
        self._next = (chosen + 1) % n
        return Lease(self.items[chosen])

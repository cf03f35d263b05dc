"""The proxy's backends: a prefill or decode instance's URL (with an optional LayerKV endpoint
given as ``#kv=HOST:PORT``), validated with errors that say what to change, and the
round-robin cursor that picks one per request."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Generic, Iterable, TypeVar
from urllib.parse import urlsplit

logger = logging.getLogger("vllm_layerkv.proxy")


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


T = TypeVar("T")


class RoundRobin(Generic[T]):
    """Cycles through a fixed list. Single-threaded (event loop), so no lock is needed."""

    def __init__(self, items: Iterable[T]) -> None:
        self.items: list[T] = list(items)
        if not self.items:
            raise ValueError("RoundRobin needs at least one item")
        self._next = 0

    def next(self) -> T:
        item = self.items[self._next]
        self._next = (self._next + 1) % len(self.items)
        return item

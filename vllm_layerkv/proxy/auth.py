"""API keys the proxy checks: the clients' (``--api-key``, as ``vllm serve --api-key`` checks
them) and the admin's (``--admin-key``: the detailed ``/health``).

A key is presented as ``Authorization: Bearer <key>``. Keys are kept as SHA-256 digests and
compared with ``hmac.compare_digest`` against every configured key, so the time an answer takes
says nothing about how much of a guess was right, nor which key matched."""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from aiohttp import web

from vllm_layerkv.proxy.errors import Refused

API_KEY_ENV = "LAYERKV_PROXY_API_KEY"
"""The clients' key when ``--api-key`` is not given (keeps it off the command line)."""
ADMIN_KEY_ENV = "LAYERKV_PROXY_ADMIN_KEY"
"""The admin key when ``--admin-key`` is not given."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class BearerKeys:
    """A set of keys, any of which a request may present (none configured: ``bool`` is False,
    and ``accepts`` refuses every request)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, request: web.Request) -> bool:
        """Whether ``request`` carries ``Authorization: Bearer <one of the keys>``."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self._digests:
            return False
        presented = _digest(token.strip())
        match = False
        for digest in self._digests:  # no early exit: every key is compared
            match |= hmac.compare_digest(presented, digest)
        return match


def unauthorized() -> Refused:
    """The answer to a request without a valid client key (401, as an OpenAI server gives)."""
    return Refused("missing or invalid API key: send the proxy's key as 'Authorization: Bearer "
                   "<key>'", status=401, type_="authentication_error",
                   headers={"WWW-Authenticate": "Bearer"})

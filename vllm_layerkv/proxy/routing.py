"""Routing: which prefill and which decode instance serve a request, picked independently of
each other, and the count of requests each instance has in flight (``Lease``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Iterable

from vllm_layerkv.proxy.backends import Backend

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

    Both pass over a backend that was unreachable within ``UNREACHABLE_BACKOFF_S``
    (backends.py), unless every backend is; then they choose among all (the request fails
    saying which instance is unreachable, rather than being refused by the proxy).

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


@dataclass
class Routers:
    """The proxy's two routers, one per role."""

    prefill: Router
    decode: Router

    def backends(self) -> list[Backend]:
        """Every instance, prefill first (the order /health reports them in)."""
        return [*self.prefill.items, *self.decode.items]

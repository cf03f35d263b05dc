"""Health: each backend's ``GET /health``, and the proxy's own ``/health``, which reports every
instance (healthy, in flight, LayerKV endpoint) and is 200 only when all of them can serve.

The proxy's ``/health`` needs no key (load balancers probe it), so by default it names each
instance by role and number only: no URL, no LayerKV endpoint, no backend error text. A request
that presents the admin key (``--admin-key``) gets the detailed view. Both views map each role
to its instances, keyed by name (``prefill instance 0``) in the open view, by URL in the
detailed one. Concurrent
``/health`` requests share one round of backend checks, so polling the proxy never multiplies
into more requests to the backends than one round at a time.

A check that cannot reach an instance marks it unreachable, so the routers pass it over for a
while (backends.UNREACHABLE_BACKOFF_S): a load balancer polling the proxy's ``/health`` keeps a
dead instance out of the rotation before any request fails on it."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from vllm_layerkv.proxy.auth import BearerKeys
from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.routing import Routers
from vllm_layerkv.proxy.tasks import BackgroundTasks
from vllm_layerkv.proxy.upstream import Upstream

HEALTH_TIMEOUT_S = 5.0


class HealthCheck(NamedTuple):
    """One backend's answer to ``GET /health``."""

    healthy: bool
    detail: str
    """What happened, with the underlying error (the detailed view and the log)."""
    summary: str
    """The same without addresses (the open view): ``HTTP 503``, ``unreachable (...)``."""


class Health:
    """Health checks of the backends, and the proxy's ``GET /health`` handler."""

    def __init__(self, upstream: Upstream, routers: Routers, discovery: Discovery,
                 background: BackgroundTasks, admin_keys: BearerKeys) -> None:
        self.upstream = upstream
        self.routers = routers
        self.discovery = discovery
        self.background = background
        self.admin_keys = admin_keys
        self.marks_unreachable = False
        """Whether a failed check marks the instance unreachable; False during start-up, where
        instances still booting are expected (startup.py turns it on when start-up is over)."""
        self._round: asyncio.Task[list[HealthCheck]] | None = None

    async def check(self, backend: Backend) -> HealthCheck:
        """The backend's ``GET /health``, with the proxy's own credentials."""
        try:
            async with self.upstream.session.get(
                    backend.url + "/health", headers=self.upstream.own_headers(None),
                    timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                await r.read()
                backend.mark_reachable()
                return HealthCheck(r.status == 200, f"HTTP {r.status}", f"HTTP {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if self.marks_unreachable:
                backend.mark_unreachable(f"/health: {type(e).__name__}: {e}")
            return HealthCheck(False, f"unreachable: {type(e).__name__}: {e}".rstrip(": "),
                               f"unreachable ({type(e).__name__})")

    async def check_all(self) -> list[HealthCheck]:
        """Every backend checked (prefill first), in one round shared by concurrent callers."""
        if self._round is None or self._round.done():
            backends = self.routers.backends()

            async def one_round() -> list[HealthCheck]:
                return list(await asyncio.gather(*(self.check(b) for b in backends)))

            self._round = self.background.spawn(one_round())
        return await asyncio.shield(self._round)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /health``: 200 with every instance's entry, or 503 naming the failing ones;
        detailed (URLs, LayerKV endpoints, errors) only for the admin key."""
        detailed = self.admin_keys.accepts(request)
        backends = self.routers.backends()
        results = await self.check_all()
        report: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
        failing: list[str] = []
        for b, result in zip(backends, results, strict=True):
            ok, detail = result.healthy, (result.detail if detailed else result.summary)
            entry: dict[str, Any] = {"healthy": ok, "status": detail, "in_flight": b.in_flight}
            if b.role == "prefill" and detailed:
                entry["layerkv_endpoint"] = ("%s:%d" % b.kv_endpoint) if b.kv_endpoint else None
            if b.role == "prefill" and ok and b.kv_endpoint is None \
                    and b.discovery_error is not None:
                # up, but requests routed to it would fail: not ready for P/D. Try again in the
                # background, so that a client polling /health before sending any request sees
                # the proxy become ready once P can answer.
                ok = entry["healthy"] = False
                detail = entry["discovery_error"] = (
                    b.discovery_error if detailed else b.discovery_failure or "")
                self.discovery.retry_in_background(b)
            report[b.role][b.url if detailed else b.name] = entry
            if not ok:
                failing.append(f"{b if detailed else b.name} ({detail})")
        if failing:
            return web.json_response({
                "status": "unhealthy", "failing": failing,
                "message": "unhealthy backends: " + "; ".join(failing), **report}, status=503)
        return web.json_response({"status": "ok", **report})

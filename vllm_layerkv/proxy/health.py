"""Health: each backend's ``GET /health``, and the proxy's own ``/health``, which reports every
instance (healthy, in flight, LayerKV endpoint) and is 200 only when all of them can serve.

A check that cannot reach an instance marks it unreachable, so the routers pass it over for a
while (backends.UNREACHABLE_BACKOFF_S): a load balancer polling the proxy's ``/health`` keeps a
dead instance out of the rotation before any request fails on it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.routing import Routers
from vllm_layerkv.proxy.upstream import Upstream

HEALTH_TIMEOUT_S = 5.0


class Health:
    """Health checks of the backends, and the proxy's ``GET /health`` handler."""

    def __init__(self, upstream: Upstream, routers: Routers, discovery: Discovery) -> None:
        self.upstream = upstream
        self.routers = routers
        self.discovery = discovery
        self.marks_unreachable = False
        """Whether a failed check marks the instance unreachable; False during start-up, where
        instances still booting are expected (startup.py turns it on when start-up is over)."""

    async def check(self, backend: Backend) -> tuple[bool, str]:
        """(healthy, detail) from the backend's ``GET /health``."""
        try:
            async with self.upstream.session.get(
                    backend.url + "/health", headers=self.upstream.headers(None, None),
                    timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                await r.read()
                backend.mark_reachable()
                return r.status == 200, f"HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if self.marks_unreachable:
                backend.mark_unreachable(f"/health: {type(e).__name__}: {e}")
            return False, f"unreachable: {type(e).__name__}: {e}".rstrip(": ")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /health``: 200 with every instance's entry, or 503 naming the failing ones."""
        backends = self.routers.backends()
        results = await asyncio.gather(*(self.check(b) for b in backends))
        report: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
        failing: list[str] = []
        for b, (ok, detail) in zip(backends, results, strict=True):
            entry: dict[str, Any] = {"healthy": ok, "status": detail,
                                     "in_flight": b.in_flight}
            if b.role == "prefill":
                entry["layerkv_endpoint"] = ("%s:%d" % b.kv_endpoint) if b.kv_endpoint else None
                if ok and b.kv_endpoint is None and b.discovery_error is not None:
                    # up, but requests routed to it would fail: not ready for P/D. Try again
                    # in the background, so that a client polling /health before sending any
                    # request sees the proxy become ready once P can answer.
                    ok = False
                    entry["discovery_error"] = detail = b.discovery_error
                    self.discovery.retry_in_background(b)
            report[b.role][b.url] = entry
            if not ok:
                failing.append(f"{b} ({detail})")
        if failing:
            return web.json_response({
                "status": "unhealthy", "failing": failing,
                "message": "unhealthy backends: " + "; ".join(failing), **report}, status=503)
        return web.json_response({"status": "ok", **report})

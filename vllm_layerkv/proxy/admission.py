"""Which requests the proxy takes on, decided from the request head alone, before any body is
read or any backend asked:

* ``--api-key``: every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (as
  ``vllm serve --api-key`` requires it on its API routes, and like it, CORS preflights
  (``OPTIONS``) pass); others get a 401 (auth.py).
* ``--max-concurrent-requests``: a request beyond the limit gets a 503 with ``Retry-After`` at
  once; nothing waits in a queue. ``GET /health`` is not counted, so that a load balancer still
  sees a busy proxy as alive (its backend checks are shared, health.py).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vllm_layerkv.proxy.auth import BearerKeys, unauthorized
from vllm_layerkv.proxy.errors import Refused

HEALTH_PATH = "/health"
RETRY_AFTER_S = 1


class Admission:
    """The client key check and the count of requests being served (``active``)."""

    def __init__(self, api_keys: BearerKeys, max_concurrent: int) -> None:
        self.api_keys = api_keys
        self.max_concurrent = max_concurrent
        self.active = 0
        """Requests between admission and the end of their handler."""

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == HEALTH_PATH:
            return await handler(request)
        refusal: Refused | None = None
        if self.api_keys and request.method != "OPTIONS" and not self.api_keys.accepts(request):
            refusal = unauthorized()
        elif self.active >= self.max_concurrent:
            refusal = Refused(f"the proxy is serving its limit of {self.max_concurrent} "
                              f"concurrent requests (--max-concurrent-requests); retry shortly",
                              status=503, type_="service_unavailable",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        if refusal is not None:
            # A body the proxy will not read is not drained either: the connection closes.
            refusal.close = request.can_read_body
            raise refusal
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1

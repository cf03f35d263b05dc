"""Start-up: wait (up to the start-up timeout) for every backend's ``/health``, then discover
each healthy prefill instance's LayerKV endpoint. It runs in the background, so the proxy
answers ``/health`` while its backends boot; requests wait for it to be over."""

from __future__ import annotations

import asyncio

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.health import Health
from vllm_layerkv.proxy.routing import Routers

logger = init_logger(__name__)

WAITING_LOG_INTERVAL_S = 30.0


class Startup:
    """The start-up task (``begin``), and the event requests wait on (``wait``)."""

    def __init__(self, routers: Routers, health: Health, discovery: Discovery,
                 timeout: float) -> None:
        self.routers = routers
        self.health = health
        self.discovery = discovery
        self.timeout = timeout
        self.ready = asyncio.Event()
        """Set when start-up is over, successful or not."""
        self.task: asyncio.Task[None] | None = None

    def begin(self) -> None:
        """Start the start-up task; call from the running event loop."""
        self.task = asyncio.create_task(self._run())

    async def wait(self) -> None:
        """Return once start-up (health wait + discovery) is over, successful or not."""
        await self.ready.wait()

    async def _run(self) -> None:
        try:
            unhealthy = await self._wait_for_health()
            await self._discover([b for b in self.routers.prefill.items if b not in unhealthy])
            logger.info("proxy ready: %d prefill, %d decode instance(s)",
                        len(self.routers.prefill.items), len(self.routers.decode.items))
        except Exception:
            logger.exception("proxy start-up failed")
        finally:
            # Requests wait for this; unknown endpoints are then discovered lazily per request.
            self.health.marks_unreachable = True
            self.ready.set()

    async def _wait_for_health(self) -> list[Backend]:
        """Poll every backend's /health until all answer 200 or the timeout passes; the
        backends still unhealthy then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        waiting = self.routers.backends()
        next_log = loop.time()
        while True:
            results = await asyncio.gather(*(self.health.check(b) for b in waiting))
            waiting = [b for b, r in zip(waiting, results, strict=True) if not r.healthy]
            now = loop.time()
            if not waiting or now >= deadline:
                break
            if now >= next_log:
                logger.info("waiting for backends to become healthy: %s",
                            ", ".join(str(b) for b in waiting))
                next_log = now + WAITING_LOG_INTERVAL_S
            await asyncio.sleep(min(1.0, max(0.0, deadline - now)))
        if waiting:
            logger.error("backends still unhealthy after %g s: %s; requests that use them "
                         "fail until they are up", self.timeout,
                         ", ".join(str(b) for b in waiting))
        return waiting

    async def _discover(self, prefill: list[Backend]) -> None:
        results = await asyncio.gather(*(self.discovery.kv_endpoint(b) for b in prefill),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):  # already names the instance
                logger.error("%s", res)

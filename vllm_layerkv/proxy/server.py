"""The proxy's listening socket: aiohttp's server behind a deadline on request heads, started
and stopped the same way by ``vllm-layerkv proxy`` and by in-process users (tests).

aiohttp bounds the size of a request head (its lines and fields), not the time it takes to
arrive, and only some versions close a new connection that stays silent. ``HeadDeadline`` closes
a connection whose first request head is not complete within ``--header-timeout`` of the
connection opening: half-sent requests cannot pile up. Between requests on a kept-alive
connection, aiohttp's keep-alive timeout (``KEEPALIVE_TIMEOUT_S``) closes it. The body has its
own deadline (body_reader.py)."""

from __future__ import annotations

import asyncio
import resource
import signal
from typing import Any, Callable

from aiohttp import web

from vllm_layerkv.common.log import init_logger

logger = init_logger(__name__)

KEEPALIVE_TIMEOUT_S = 75.0
"""An idle kept-alive client connection is closed after this long (aiohttp's default; above
the 15 s for which HTTP clients such as aiohttp's keep idle connections, so that a client never
reuses a connection just as the proxy closes it)."""

LINGERING_S = 2.0
"""After an answer that left the request body unread (a 401, 408, 413 or 503), the rest of the
body is read and dropped for at most this long before the connection closes: long enough for a
client still sending to get the answer rather than a reset connection, short enough that a
client sending slowly is cut off soon after (aiohttp's default is 10 s)."""

MAX_BACKLOG = 4096
"""The listen backlog follows the concurrency limit up to this (Linux's default somaxconn): a
burst of new connections waits in the kernel's queue instead of having its handshakes dropped
(the default backlog of 100 stalls a burst of a few hundred clients by seconds)."""

FDS_PER_REQUEST = 3
"""A P/D request holds the client's connection, and one to P and one to D."""


class HeadDeadline:
    """Closes connections whose first request head is late.

    Connections are watched from their creation (``protocol_factory``) until a request starts
    on them (``middleware``), and checked by one sweeper task every ``interval`` seconds, which
    also forgets connections the client closed: a flood of connections that never send
    anything holds no more than about ``timeout`` seconds of them."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.interval = min(1.0, timeout / 4)
        self._deadlines: dict[Any, float] = {}
        """aiohttp RequestHandler (one per connection) -> loop time its head is due."""
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def watched(self) -> int:
        """Connections still waiting for their first request head."""
        return len(self._deadlines)

    def protocol_factory(self, factory: Callable[[], asyncio.Protocol]
                         ) -> Callable[[], asyncio.Protocol]:
        """``factory`` (aiohttp's server), with each new connection watched."""

        def watched_connection() -> asyncio.Protocol:
            handler = factory()
            loop = asyncio.get_running_loop()
            self._deadlines[handler] = loop.time() + self.timeout
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = loop.create_task(self._sweep())
            return handler

        return watched_connection

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self._deadlines.pop(request.protocol, None)  # its head is in
        return await handler(request)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while self._deadlines:
            await asyncio.sleep(self.interval)
            now = loop.time()
            for handler, due in list(self._deadlines.items()):
                if handler.transport is None:  # closed by the client
                    del self._deadlines[handler]
                elif now >= due:
                    del self._deadlines[handler]
                    logger.debug("closing a connection whose request head took over %g s",
                                 self.timeout)
                    handler.force_close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        self._deadlines.clear()


class ProxyServer:
    """A running proxy: ``start`` listens, ``close`` stops listening, closes the connections
    and runs the application's clean-up."""

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer,
                 heads: HeadDeadline) -> None:
        self.runner = runner
        self.server = server
        self.heads = heads

    @classmethod
    async def start(cls, app: web.Application, heads: HeadDeadline, host: str, port: int,
                    max_concurrent_requests: int) -> ProxyServer:
        """Serve ``app`` on host:port (port 0: a free one, see ``port``).

        ``handler_cancellation``: a client disconnect cancels the handler, and with it both
        upstream requests. No access log: one line per request would cost real time at
        benchmark rates; requests are logged at DEBUG with their transfer_id instead."""
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=KEEPALIVE_TIMEOUT_S, lingering_time=LINGERING_S)
        await runner.setup()
        try:
            server = await asyncio.get_running_loop().create_server(
                heads.protocol_factory(runner.server), host, port, reuse_address=True,
                backlog=min(max(128, max_concurrent_requests), MAX_BACKLOG))
        except BaseException:
            await runner.cleanup()
            raise
        return cls(runner, server, heads)

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        await self.heads.close()
        await self.runner.cleanup()


async def serve_until_signalled(app: web.Application, heads: HeadDeadline, host: str,
                                port: int, max_concurrent_requests: int) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly."""
    server = await ProxyServer.start(app, heads, host, port, max_concurrent_requests)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.close()


def raise_open_file_limit(max_concurrent_requests: int) -> None:
    """Raise the soft limit on open files up to the hard one, so that the concurrency limit,
    not the file limit, is what refuses requests; warn if even the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FDS_PER_REQUEST * max_concurrent_requests + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d: %s", soft, e)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning("the open-file limit (%d) is below what %d concurrent requests need "
                       "(about %d); raise it (ulimit -n) or lower --max-concurrent-requests",
                       soft, max_concurrent_requests, wanted)

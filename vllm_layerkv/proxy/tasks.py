"""The proxy's asyncio tasks: upstream requests cancelled and waited for (so that their
connections are closed), and the tasks that outlive the handler that started them (P finishing
after D has answered, a discovery retried from ``/health``), kept until they end and cancelled
when the proxy stops."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Iterable

import aiohttp


def close_response(task: asyncio.Task[Any]) -> None:
    """Close the open upstream response a finished task handed back, if any (D's stream that
    nothing relayed, because the answer ended at P's token or the client left): a no-op after a
    full read and release; otherwise it drops the connection, which makes vLLM abort the
    request."""
    if task.done() and not task.cancelled() and task.exception() is None:
        res = task.result()
        if isinstance(res, aiohttp.ClientResponse):
            res.close()


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel unfinished tasks and wait until they have unwound (their upstream connections are
    closed by then); close any open upstream response a finished task handed back."""
    pending = []
    for t in tasks:
        if t is None:
            continue
        if not t.done():
            t.cancel()
            pending.append(t)
        else:
            close_response(t)
    if pending:
        await asyncio.wait(pending)
        for t in pending:
            close_response(t)


class BackgroundTasks:
    """Tasks no handler waits for: held here so that they are not garbage-collected while they
    run, and so that the proxy can cancel them when it stops."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

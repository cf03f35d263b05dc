"""One P/D request once both of its upstream requests are on their way (P's: prefill, one
token, keep the KV; D's: the client's request, its KV from P), and the client's answer made
from them.

``Exchange.answer`` is D's answer (its JSON, or its stream relayed chunk by chunk) while P is
watched. If P fails before D has answered, D is cancelled and P's error goes to the client; if
P fails while D streams, D would only wait for KV that never comes, so the stream is ended with
P's error. Once D has succeeded, P is left to finish in the background. With
``--first-token-from-prefill`` an eligible request is answered by ``FirstTokenExchange``
(first_token_exchange.py) instead.

Whatever way a request ends, both upstream requests are then over or cancelled (cancelling
closes the connection, which makes vLLM abort the request).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.errors import UpstreamError, UpstreamReply
from vllm_layerkv.proxy.relay import StreamRelay
from vllm_layerkv.proxy.tasks import BackgroundTasks, cancel_and_wait

logger = init_logger(__name__)

# After D has fully answered, a still-running P request is left to finish on its own (aborting
# it could race the connector's end-of-transfer bookkeeping); it is cancelled after this long.
PREFILL_GRACE_S = 300.0


@dataclass
class ClientRequest:
    """A client's generation request, checked, with the transfer_id the proxy gave it."""

    http: web.Request
    body: dict[str, Any]
    chat: bool
    tid: str
    first_token: bool = False
    """The client's first token is P's (first_token.py)."""


def prefill_failure(task: asyncio.Task[Any]) -> UpstreamReply | UpstreamError | None:
    """The failure of a finished prefill task, or None if P answered 200."""
    exc = task.exception()
    if exc is not None:
        if isinstance(exc, UpstreamError):
            return exc
        raise exc
    reply = task.result()
    return None if reply.status == 200 else reply


def answered_ok(task: asyncio.Task[Any]) -> bool:
    """A finished upstream task holding a complete 200 reply. An open stream does not count:
    its tokens still depend on the KV from P."""
    if task.cancelled() or task.exception() is not None:
        return False
    res = task.result()
    return isinstance(res, UpstreamReply) and res.status == 200


async def finish_prefill_later(task: asyncio.Task[Any], tid: str) -> None:
    """Let P's request end on its own after D has answered (within PREFILL_GRACE_S), and log
    how it ended if it failed: the client has its answer already."""
    try:
        res = await asyncio.wait_for(asyncio.shield(task), PREFILL_GRACE_S)
    except asyncio.TimeoutError:
        logger.warning("transfer %s: prefill still running %.0f s after decode finished; "
                       "cancelling it", tid, PREFILL_GRACE_S)
        await cancel_and_wait([task])
        return
    except asyncio.CancelledError:
        await cancel_and_wait([task])
        raise
    except Exception as e:  # already answered the client; just record it
        logger.warning("transfer %s: prefill failed after decode finished: %s", tid, e)
        return
    if isinstance(res, UpstreamReply) and res.status != 200:
        logger.warning("transfer %s: prefill answered HTTP %d after decode finished: %s",
                       tid, res.status, res.body[:300])


@dataclass
class Exchange:
    """A P/D request in flight: P's and D's tasks (``Upstream.post``), sent at the same time,
    and the client answered from them."""

    client: ClientRequest
    decode: Backend
    p_task: asyncio.Task[Any]
    d_task: asyncio.Task[Any]
    tracer: Tracer
    background: BackgroundTasks
    """Where P goes on after D has answered."""
    out_headers: dict[str, str] = field(init=False)
    """Headers of every answer to the client: the transfer_id as ``X-Request-Id``."""
    _relay_task: asyncio.Task[None] | None = field(default=None, init=False)
    _keep_prefill: bool = field(default=False, init=False)
    """True once D has succeeded: P may finish in the background."""

    def __post_init__(self) -> None:
        self.out_headers = {"X-Request-Id": self.client.tid}

    def _trace_end(self) -> None:
        self.tracer.event("proxy_out", transfer_id=self.client.tid)
        self.tracer.flush()

    async def answer(self) -> web.StreamResponse:
        """D's answer, P watched."""
        try:
            d_res = await self._until_decode_answers()
            if isinstance(d_res, web.StreamResponse):
                return d_res
            return await self._relay_decode_stream(d_res)
        finally:
            self._trace_end()
            # Runs on every exit, including cancellation when the client disconnects.
            if self._keep_prefill:
                self._finish_prefill_in_background()
                await cancel_and_wait([self.d_task, self._relay_task])
            else:
                await cancel_and_wait([self.p_task, self.d_task, self._relay_task])

    async def _until_decode_answers(self) -> web.StreamResponse | aiohttp.ClientResponse:
        """Until D answers (the headers of a stream, or a whole JSON body), watch P. Returns the
        client's answer, or D's open stream."""
        tid = self.client.tid
        pending: set[asyncio.Task[Any]] = {self.p_task, self.d_task}
        while self.d_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.p_task in done:
                failure = prefill_failure(self.p_task)
                if failure is not None and not (self.d_task in done
                                                and answered_ok(self.d_task)):
                    logger.debug("request %s: prefill failed, cancelling decode", tid)
                    return failure.response(self.out_headers)
        try:
            d_res = self.d_task.result()
        except UpstreamError as e:
            return e.response(self.out_headers)
        if isinstance(d_res, UpstreamReply):
            if d_res.status == 200:
                self._keep_prefill = True
            else:
                logger.debug("request %s: decode answered HTTP %d, cancelling prefill",
                             tid, d_res.status)
            return d_res.response(self.out_headers)
        return d_res

    async def _relay_decode_stream(self, d_res: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay D's stream while still watching P."""
        tid = self.client.tid
        relay = StreamRelay(self.client.http, d_res, self.decode, self.out_headers, on_first=(
            (lambda: self.tracer.event("proxy_d_first", transfer_id=tid))
            if self.tracer.enabled else None))
        relay_task = self._relay_task = asyncio.create_task(relay.run())
        pending = {relay_task} | ({self.p_task} if not self.p_task.done() else set())
        while relay_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.p_task in done:
                failure = prefill_failure(self.p_task)
                if failure is not None:
                    await cancel_and_wait([relay_task])
                    logger.debug("request %s: prefill failed mid-stream, cancelling decode", tid)
                    return await self._end_stream_with(relay, failure)
        self._keep_prefill = relay_task.exception() is None
        return await relay.answer(relay_task, tid)

    async def _end_stream_with(self, relay: StreamRelay,
                               failure: UpstreamReply | UpstreamError) -> web.StreamResponse:
        """P's failure as the client's answer: its status and body if nothing was streamed
        yet, else an error event that ends the stream."""
        if relay.response is None:
            return failure.response(self.out_headers)
        if isinstance(failure, UpstreamReply):
            msg, type_ = failure.error_message()
            await relay.finish_with_error(failure.status, f"prefill failed: {msg}", type_)
        else:
            await relay.finish_with_error(failure.status, failure.report(), "bad_gateway")
        return relay.response

    def _finish_prefill_in_background(self) -> None:
        task, tid = self.p_task, self.client.tid
        if task.done():
            if not task.cancelled() and task.exception() is not None:  # retrieve, and record
                logger.warning("transfer %s: prefill failed after decode finished: %s", tid,
                               task.exception())
            return
        self.background.spawn(finish_prefill_later(task, tid))

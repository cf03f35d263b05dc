"""D's streamed answer, copied to the client chunk by chunk as it arrives."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

import aiohttp
from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.errors import UpstreamError, sse_error
from vllm_layerkv.proxy.upstream import broke_off

logger = init_logger(__name__)


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class StreamEdit(Protocol):
    """Rewrites a stream on its way through (first_token.UsagePlusOne)."""

    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


async def open_stream(request: web.Request, status: int, content_type: str,
                      headers: dict[str, str]) -> web.StreamResponse:
    """The client's streamed response, headers sent."""
    response = web.StreamResponse(status=status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache", **headers})
    try:
        await response.prepare(request)
    except (ConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from None
    return response


class StreamRelay:
    """Copies an upstream SSE response to the client chunk by chunk.

    The client response is only prepared when the first upstream chunk is in hand, so that an
    error that happens before anything was streamed (e.g. P fails while D waits for the KV) can
    still be returned with its real HTTP status; unless ``response`` is one already under way
    (P's first token went out on it). ``edit`` rewrites the stream on its way through.
    """

    def __init__(self, request: web.Request, upstream: aiohttp.ClientResponse,
                 backend: Backend, headers: dict[str, str],
                 on_first: Callable[[], None] | None = None,
                 response: web.StreamResponse | None = None,
                 edit: StreamEdit | None = None) -> None:
        self.on_first = on_first
        self.request = request
        self.upstream = upstream
        self.backend = backend
        self.headers = headers
        self.response = response
        self.edit = edit

    async def _write(self, data: bytes, edited: bool = False) -> None:
        assert self.response is not None
        if self.edit is not None and not edited:
            data = self.edit.feed(data)
        if not data:
            return
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as e:  # RuntimeError: "transport is closing"
            raise ClientGone(str(e)) from None

    async def run(self) -> None:
        up = self.upstream
        try:
            first = await up.content.readany()
            if self.on_first is not None:
                self.on_first()
            if self.response is None:
                self.response = await open_stream(
                    self.request, up.status,
                    up.headers.get("Content-Type", "text/event-stream"), self.headers)
            if first:
                await self._write(first)
            # iter_any yields whatever has arrived, so each upstream chunk is forwarded (and
            # written to the socket) as soon as it is read: no buffering that would skew TTFT.
            async for chunk in up.content.iter_any():
                await self._write(chunk)
            if self.edit is not None:
                await self._write(self.edit.flush(), edited=True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise broke_off(self.backend, e) from None
        finally:
            if up.content.is_eof():
                up.release()  # connection back to the pool
            else:
                up.close()  # cut short (client gone, P failed): closing makes vLLM abort

    async def answer(self, task: asyncio.Task[None], tid: str) -> web.StreamResponse:
        """The handler's return value once ``task`` (running ``run``) is over: the stream, ended
        with an error event if D broke off; the error itself if nothing was streamed yet."""
        try:
            await task
        except ClientGone:
            logger.debug("request %s: client disconnected", tid)
        except UpstreamError as e:
            if self.response is None:
                return e.response({"X-Request-Id": tid})
            await self.finish_with_error(502, e.report(), "bad_gateway")
        assert self.response is not None
        return self.response

    async def finish_with_error(self, status: int, message: str, type_: str) -> None:
        """End an already started stream with an SSE error event (what vLLM does itself)."""
        assert self.response is not None
        await self.finish(self.response, status, message, type_)

    @staticmethod
    async def finish(response: web.StreamResponse, status: int, message: str,
                     type_: str) -> None:
        try:
            await response.write(sse_error(status, message, type_))
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass

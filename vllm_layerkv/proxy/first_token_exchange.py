"""``--first-token-from-prefill``: a P/D request answered with P's token as the client's first
token, as soon as P answers, and then D's answer, which continues from it (D's connector appends
P's token to D's prompt). The answers themselves are made by first_token.py; this is when they
are sent, and what happens when P or D fails, or the client leaves, on the way."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.errors import UpstreamError, UpstreamReply, encode_json
from vllm_layerkv.proxy.exchange import Exchange, prefill_failure
from vllm_layerkv.proxy.first_token import PrefillToken, UsagePlusOne
from vllm_layerkv.proxy.relay import ClientGone, StreamRelay, open_stream
from vllm_layerkv.proxy.tasks import cancel_and_wait, close_response

logger = init_logger(__name__)


class FirstTokenExchange(Exchange):
    """A P/D request whose first token is P's: P's answer is awaited first, D's after it."""

    async def answer(self) -> web.StreamResponse:
        """P's token is the client's first token, D's answer the rest (D's connector appends
        P's token to D's prompt). P answers first: D needs P's KV and token before it can make
        anything."""
        try:
            return await self._prefill_token_then_decode()
        except ClientGone:
            logger.debug("request %s: client disconnected", self.client.tid)
            return web.Response(status=499)  # nobody reads it
        finally:
            self._trace_end()
            await cancel_and_wait([self.p_task, self.d_task])
            close_response(self.d_task)

    async def _prefill_token_then_decode(self) -> web.StreamResponse:
        first = await self._until_prefill_answers()
        if isinstance(first, web.StreamResponse):
            return first
        self.tracer.event("proxy_p_token", transfer_id=self.client.tid)
        body = self.client.body
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if first.ends_answer:  # P stopped at its token: D (cancelled on return) adds nothing
            return await self._prefill_token_alone(first, stream, include_usage)
        if not stream:
            return await self._prefill_token_before_decode_json(first)
        return await self._prefill_token_before_decode_stream(first)

    async def _until_prefill_answers(self) -> web.StreamResponse | PrefillToken:
        """Until P answers, D failing first fails the request. Returns P's token, or the
        client's answer when there is none."""
        pending: set[asyncio.Task[Any]] = {self.p_task, self.d_task}
        while self.p_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.d_task in done and self.p_task in pending:
                try:
                    d_res = self.d_task.result()
                except UpstreamError as e:
                    return e.response(self.out_headers)
                if isinstance(d_res, UpstreamReply) and d_res.status != 200:
                    return d_res.response(self.out_headers)
        failure = prefill_failure(self.p_task)
        if failure is not None:
            return failure.response(self.out_headers)
        try:
            return PrefillToken.parse(self.p_task.result().body)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            p = self.p_task.result().backend
            return UpstreamError(p, f"{p.name} answered without a token",
                                 f"{p} answered without a token: {e!r}").response(
                self.out_headers)

    async def _prefill_token_alone(self, first: PrefillToken, stream: bool,
                                   include_usage: bool) -> web.StreamResponse:
        """P's answer is the whole answer."""
        if not stream:
            return web.Response(body=first.as_answer(), headers={
                "Content-Type": "application/json", **self.out_headers})
        response = await open_stream(self.client.http, 200, "text/event-stream",
                                     self.out_headers)
        try:
            await response.write(first.first_chunk(final=True) +
                                 first.final_events(include_usage))
        except (ConnectionError, RuntimeError):
            pass  # the client is gone
        return response

    async def _prefill_token_before_decode_json(self, first: PrefillToken
                                                ) -> web.StreamResponse:
        """D's JSON answer with P's token in front."""
        try:
            d_res = await self.d_task
        except UpstreamError as e:
            return e.response(self.out_headers)
        assert isinstance(d_res, UpstreamReply)
        if d_res.status != 200:
            return d_res.response(self.out_headers)
        return web.Response(body=first.merge_reply(d_res.body), headers={
            "Content-Type": "application/json", **self.out_headers})

    async def _prefill_token_before_decode_stream(self, first: PrefillToken
                                                  ) -> web.StreamResponse:
        """P's token as the first event, sent at once, then D's stream with its usage counting
        P's token; D failing now ends the stream with an error event."""
        response = await open_stream(self.client.http, 200, "text/event-stream",
                                     self.out_headers)
        try:
            await response.write(first.first_chunk(final=False))
        except (ConnectionError, RuntimeError):
            return response  # the client is gone; D is cancelled on return
        try:
            d_res = await self.d_task
        except UpstreamError as e:
            d_res = UpstreamReply(self.decode, e.status, encode_json({"error": {
                "message": e.report(), "type": "bad_gateway"}}), "application/json")
        if isinstance(d_res, UpstreamReply):  # D answered with an error after P's token
            msg, type_ = d_res.error_message()
            await StreamRelay.finish(response, d_res.status, f"decode failed: {msg}", type_)
            return response
        tid = self.client.tid
        relay = StreamRelay(self.client.http, d_res, self.decode, self.out_headers,
                            response=response, edit=UsagePlusOne(), on_first=(
                                (lambda: self.tracer.event("proxy_d_first", transfer_id=tid))
                                if self.tracer.enabled else None))
        relay_task = asyncio.create_task(relay.run())
        try:
            return await relay.answer(relay_task, self.client.tid)
        finally:
            await cancel_and_wait([relay_task])

"""Request orchestration: the proxy's generation endpoints, and ``GET /v1/models``.

Each ``/v1/completions`` or ``/v1/chat/completions`` request is read within the body limits
(body_reader.py), checked (400 with what to change), stripped of any ``kv_transfer_params`` the
client sent (the proxy writes them), given a fresh transfer_id (what P and D match the KV
transfer on), and served by a prefill and a decode instance picked independently of each
other, with both upstream requests sent at the same time; exchange.py (or
first_token_exchange.py) answers the client from them. A request that needs prompt logprobs,
which D never computes, is served by a prefill instance alone. Every upstream request carries
the client's own ``Authorization`` header, or none (upstream.py).

Each request holds its instances (routing.Lease) until they are done with it: D until its
answer is relayed (or cut off), P until its own request ends, which may be after the handler
has returned.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.bodies import (
    decode_body,
    needs_prompt_logprobs,
    parse_request_body,
    prefill_body,
    strip_transfer_params,
)
from vllm_layerkv.proxy.body_reader import read_body
from vllm_layerkv.proxy.config import ProxyConfig
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.errors import UpstreamError, UpstreamReply, encode_json
from vllm_layerkv.proxy.exchange import ClientRequest, Exchange
from vllm_layerkv.proxy.first_token import ineligible
from vllm_layerkv.proxy.first_token_exchange import FirstTokenExchange
from vllm_layerkv.proxy.relay import StreamRelay
from vllm_layerkv.proxy.routing import Lease, Routers
from vllm_layerkv.proxy.startup import Startup
from vllm_layerkv.proxy.tasks import BackgroundTasks, cancel_and_wait
from vllm_layerkv.proxy.upstream import Upstream, unreachable

logger = init_logger(__name__)


@dataclass
class Orchestrator:
    """The handlers of ``POST /v1/completions``, ``POST /v1/chat/completions`` and
    ``GET /v1/models``."""

    routers: Routers
    upstream: Upstream
    discovery: Discovery
    startup: Startup
    """P/D requests wait for start-up (health wait + discovery) to be over."""
    background: BackgroundTasks
    tracer: Tracer
    """Per-request timestamps (arrival, D's first bytes, end) by transfer_id, for the TTFT
    profile (benchmarks/profile_trace.py); off unless --trace is given."""
    config: ProxyConfig
    """The body limits, and whether to answer eligible requests with P's token first (D then
    continues from it, first_token.py)."""

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``, forwarded to a decode instance (picked as for a request)."""
        lease = self.routers.decode.pick()
        d = lease.backend
        try:
            async with self.upstream.session.get(
                    d.url + "/v1/models", headers=self.upstream.client_headers(request, None)
            ) as r:
                body = await r.read()
                return web.Response(status=r.status, body=body, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            d.mark_unreachable(f"{type(e).__name__}: {e}")
            raise unreachable(d, e) from None
        finally:
            lease.release()

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        config = self.config
        raw = await read_body(request, config.max_body_bytes, config.body_timeout)
        body = parse_request_body(raw, chat, config.max_json_depth)
        tid = uuid.uuid4().hex
        if strip_transfer_params(body):
            logger.debug("request %s: the client's kv_transfer_params removed", tid)
            raw = encode_json(body)
        if needs_prompt_logprobs(body, chat):
            return await self._serve_prefill_only(request, raw, tid)
        first_token = False
        if config.first_token_from_prefill:
            why_not = ineligible(body, chat)
            first_token = why_not is None
            if why_not is not None:
                logger.debug("request %s: D makes the first token itself: %s", tid, why_not)
        return await self._serve_pd(ClientRequest(request, body, chat, tid, first_token))

    async def _serve_prefill_only(self, request: web.Request, raw: bytes, tid: str
                                  ) -> web.StreamResponse:
        """Prompt-logprob requests: P computes the prompt's logits, D never does. The client's
        body goes to P byte for byte (re-encoded only when its kv_transfer_params were
        removed), and P's answer back."""
        lease = self.routers.prefill.pick()
        p = lease.backend
        logger.debug("request %s: prompt logprobs -> prefill-only P=%s", tid, p.url)
        task = asyncio.create_task(self.upstream.post(
            p, request.path, raw, self.upstream.client_headers(request, tid), True))
        relay_task: asyncio.Task[None] | None = None
        try:
            try:
                res = await task
            except UpstreamError as e:
                return e.response({"X-Request-Id": tid})
            if isinstance(res, UpstreamReply):
                return res.response({"X-Request-Id": tid})
            relay = StreamRelay(request, res, p, {"X-Request-Id": tid})
            relay_task = asyncio.create_task(relay.run())
            return await relay.answer(relay_task, tid)
        finally:
            await cancel_and_wait([task, relay_task])
            lease.release()

    async def _serve_pd(self, client: ClientRequest) -> web.StreamResponse:
        """Pick P and D, and hold each until that instance is done with the request: D until
        its answer is relayed (or cut off), P until its own request ends (``Lease.end_with``)."""
        p_lease, d_lease = self.routers.prefill.pick(), self.routers.decode.pick()
        try:
            return await self._serve_pd_on(p_lease, d_lease.backend, client)
        finally:
            d_lease.release()
            if p_lease.task is None:  # returned before P was asked
                p_lease.release()

    async def _serve_pd_on(self, p_lease: Lease, d: Backend, client: ClientRequest
                           ) -> web.StreamResponse:
        """One P/D request on the chosen instances: P's LayerKV endpoint (D registers there),
        then both requests sent at once."""
        p, tid, body = p_lease.backend, client.tid, client.body
        await self.startup.wait()  # no-op once start-up discovery is over
        try:
            host, port = await self.discovery.kv_endpoint(p)
        except UpstreamError as e:
            return e.response({"X-Request-Id": tid})
        logger.debug("request %s: P=%s D=%s (LayerKV %s:%d) path=%s stream=%s", tid, p.url,
                     d.url, host, port, client.http.path, bool(body.get("stream")))

        path, headers = client.http.path, self.upstream.client_headers(client.http, tid)
        self.tracer.event("proxy_in", transfer_id=tid)
        # Both in flight at once: D registers with P while P prefills, and P streams the KV
        # layer group by layer group; waiting for P's answer first would serialise exactly what
        # LayerKV overlaps. D's request goes out first: P holds the prefill until D's
        # registration is there, and D registers only once it has allocated the prompt's
        # blocks, so D is the side that is usually later.
        d_task = asyncio.create_task(self.upstream.post(
            d, path, encode_json(decode_body(body, tid, host, port, client.first_token)),
            headers, True))
        p_task = asyncio.create_task(self.upstream.post(
            p, path, encode_json(prefill_body(body, tid, client.chat, client.first_token)),
            headers, False))
        p_lease.end_with(p_task)
        exchange_type = FirstTokenExchange if client.first_token else Exchange
        exchange = exchange_type(client, d, p_task, d_task, self.tracer, self.background)
        return await exchange.answer()

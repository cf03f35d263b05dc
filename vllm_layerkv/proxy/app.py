"""The proxy itself: start-up (health wait, discovery of each prefill instance's LayerKV
endpoint), the request handlers that send P's and D's requests at the same time and relay D's
answer, /v1/models and /health, and the aiohttp application around them (the request flow is
in the package docstring, ``vllm_layerkv/proxy/__init__.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.proxy.backends import (
    Backend,
    Lease,
    Router,
    parse_backend_url,
    parse_hostport,
)
from vllm_layerkv.proxy.bodies import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    decode_body,
    needs_prompt_logprobs,
    parse_request_body,
    prefill_body,
)
from vllm_layerkv.proxy.errors import (
    BadRequest,
    UpstreamError,
    UpstreamReply,
    encode_json,
    error_response,
)
from vllm_layerkv.proxy.first_token import PrefillToken, UsagePlusOne, ineligible
from vllm_layerkv.proxy.relay import ClientGone, StreamRelay, open_stream

logger = init_logger(__name__)

# Prompts can be long (and chat requests may carry base64 images): aiohttp's default 1 MiB
# request-body limit would reject legitimate long-context benchmark requests.
MAX_REQUEST_BYTES = 256 * 1024 * 1024

# vLLM's HTTP server (uvicorn) closes idle keep-alive connections after 5 s by default. A pooled
# client connection that is reused just as the server closes it fails the POST (aiohttp does not
# retry non-idempotent requests), so pooled connections are dropped a little earlier than that.
UPSTREAM_KEEPALIVE_S = 3.0

HEALTH_TIMEOUT_S = 5.0
DISCOVERY_TIMEOUT_S = 120.0
# After D has fully answered, a still-running P request is left to finish on its own (aborting
# it could race the connector's end-of-transfer bookkeeping); it is cancelled after this long.
PREFILL_GRACE_S = 300.0

_UNSPECIFIED_HOSTS = {"", "0.0.0.0", "::", "[::]"}


async def _cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel unfinished tasks and wait until they have unwound (their upstream connections are
    closed by then); close any open upstream response a finished task handed back."""
    pending = []
    for t in tasks:
        if t is None:
            continue
        if not t.done():
            t.cancel()
            pending.append(t)
        elif not t.cancelled() and t.exception() is None:
            res = t.result()
            if isinstance(res, aiohttp.ClientResponse):
                res.close()  # no-op after a full read + release; drops the connection otherwise
    if pending:
        await asyncio.wait(pending)
        for t in pending:
            if not t.cancelled() and t.exception() is None:
                res = t.result()
                if isinstance(res, aiohttp.ClientResponse):
                    res.close()


def _close_unrelayed(task: asyncio.Task[Any]) -> None:
    """Close D's stream if nothing relayed it (the answer ended at P's token, or the client
    left): closing the connection is what makes vLLM abort the request."""
    if task.done() and not task.cancelled() and task.exception() is None:
        res = task.result()
        if isinstance(res, aiohttp.ClientResponse):
            res.close()


def _answered_ok(task: asyncio.Task[Any]) -> bool:
    """A finished upstream task holding a complete 200 reply. An open stream does not count:
    its tokens still depend on the KV from P."""
    if task.cancelled() or task.exception() is not None:
        return False
    res = task.result()
    return isinstance(res, UpstreamReply) and res.status == 200


class ProxyApp:
    """State and handlers of one proxy: backends, their routers, the HTTP client."""

    def __init__(self, prefill: Sequence[Backend], decode: Sequence[Backend], *,
                 startup_timeout: float = 600.0, connect_timeout: float = 10.0,
                 api_key: str | None = None, trace_path: str = "",
                 first_token_from_prefill: bool = False, routing: str = "least-loaded") -> None:
        self.prefill = Router(prefill, routing)
        self.first_token_from_prefill = first_token_from_prefill
        """Answer eligible requests with P's token first; D continues from it
        (first_token.py)."""
        self.tracer = Tracer(trace_path, "proxy", 0)
        """Per-request timestamps (arrival, D's first bytes, end) by transfer_id, for
        the TTFT profile (benchmarks/profile_trace.py); off unless --trace is given."""
        self.decode = Router(decode, routing)
        self.startup_timeout = startup_timeout
        self.connect_timeout = connect_timeout
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()  # set when start-up (health wait + discovery) is over
        self._startup_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "ProxyApp used outside a running aiohttp app"
        return self._session

    async def on_startup(self, app: web.Application) -> None:
        # One pooled session for everything. No total timeout: a streamed generation may run
        # for minutes. Only establishing a connection is bounded, so a dead backend fails fast.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout))
        # Start-up runs in the background so the proxy answers /health while backends boot.
        self._startup_task = asyncio.create_task(self._startup())

    async def on_cleanup(self, app: web.Application) -> None:
        await _cancel_and_wait([self._startup_task, *self._background])
        if self._session is not None:
            await self._session.close()

    async def wait_ready(self) -> None:
        """Return once start-up (health wait + discovery) is over, successful or not."""
        await self._ready.wait()

    def _upstream_headers(self, request: web.Request | None, request_id: str | None
                          ) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        auth = request.headers.get("Authorization") if request is not None else None
        if auth:
            headers["Authorization"] = auth
        elif self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    # -- health and discovery -----------------------------------------------------------------

    def all_backends(self) -> list[Backend]:
        return [*self.prefill.items, *self.decode.items]

    async def check_health(self, backend: Backend) -> tuple[bool, str]:
        """(healthy, detail) from the backend's ``GET /health``."""
        try:
            async with self.session.get(backend.url + "/health", headers=self._upstream_headers(
                    None, None), timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                await r.read()
                backend.mark_reachable()
                return r.status == 200, f"HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if self._ready.is_set():  # at start-up, instances still booting are expected
                backend.mark_unreachable(f"/health: {type(e).__name__}: {e}")
            return False, f"unreachable: {type(e).__name__}: {e}".rstrip(": ")

    async def _startup(self) -> None:
        """Wait (up to startup_timeout) for every backend's /health, then discover endpoints."""
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.startup_timeout
            waiting = self.all_backends()
            next_log = loop.time()
            while True:
                results = await asyncio.gather(*(self.check_health(b) for b in waiting))
                waiting = [b for b, (ok, _) in zip(waiting, results, strict=True) if not ok]
                now = loop.time()
                if not waiting or now >= deadline:
                    break
                if now >= next_log:
                    logger.info("waiting for backends to become healthy: %s",
                                ", ".join(str(b) for b in waiting))
                    next_log = now + 30.0
                await asyncio.sleep(min(1.0, max(0.0, deadline - now)))
            if waiting:
                logger.error("backends still unhealthy after %g s: %s; requests that use them "
                             "fail until they are up", self.startup_timeout,
                             ", ".join(str(b) for b in waiting))
            to_discover = [b for b in self.prefill.items if b not in waiting]
            results = await asyncio.gather(*(self.kv_endpoint(b) for b in to_discover),
                                           return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):  # already names the instance
                    logger.error("%s", res)
            logger.info("proxy ready: %d prefill, %d decode instance(s)",
                        len(self.prefill.items), len(self.decode.items))
        except Exception:
            logger.exception("proxy start-up failed")
        finally:
            # Requests wait for this; unknown endpoints are then discovered lazily per request.
            self._ready.set()

    async def kv_endpoint(self, backend: Backend) -> tuple[str, int]:
        """The LayerKV endpoint of a prefill instance: cached, else discovered now."""
        if backend.kv_endpoint is not None:
            return backend.kv_endpoint
        async with backend.discover_lock:  # one probe at a time per instance
            if backend.kv_endpoint is None:
                try:
                    backend.kv_endpoint = await self._discover(backend)
                except UpstreamError as e:
                    backend.discovery_error = str(e)
                    raise
                backend.discovery_error = None
                logger.info("%s: LayerKV endpoint %s:%d (discovered)", backend,
                            *backend.kv_endpoint)
            return backend.kv_endpoint

    async def _discover(self, backend: Backend) -> tuple[str, int]:
        timeout = aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S)
        headers = self._upstream_headers(None, f"layerkv-discover-{uuid.uuid4().hex}")
        try:
            async with self.session.get(backend.url + "/v1/models", headers=headers,
                                        timeout=timeout) as r:
                text = await r.text(errors="replace")
                if r.status != 200:
                    raise UpstreamError(backend, f"LayerKV discovery: GET {backend.url}/v1/models "
                                        f"answered HTTP {r.status}: {text[:500]}")
            try:
                model = json.loads(text)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise UpstreamError(backend, f"LayerKV discovery: GET {backend.url}/v1/models "
                                    f"returned no model id: {text[:500]}") from None
            probe = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0,
                     "kv_transfer_params": {"layerkv_discover": True}}
            async with self.session.post(backend.url + COMPLETIONS_PATH, data=encode_json(probe),
                                         headers=headers, timeout=timeout) as r:
                text = await r.text(errors="replace")
                if r.status != 200:
                    raise UpstreamError(backend, f"LayerKV discovery probe to {backend.url}"
                                        f"{COMPLETIONS_PATH} answered HTTP {r.status}: "
                                        f"{text[:500]}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise UpstreamError(backend, f"LayerKV discovery: {backend} is unreachable: "
                                f"{type(e).__name__}: {e}") from None
        try:
            kv = json.loads(text).get("kv_transfer_params") or {}
        except (ValueError, AttributeError):
            kv = {}
        endpoint = kv.get("layerkv_endpoint") if isinstance(kv, dict) else None
        if not endpoint or not isinstance(endpoint, str):
            extra = (f" (connector said: {kv['layerkv_error']})"
                     if isinstance(kv, dict) and kv.get("layerkv_error") else "")
            raise UpstreamError(backend, (
                f"prefill instance {backend.url} does not run the LayerKV connector as "
                f"kv_producer: its answer to the discovery probe has no "
                f"kv_transfer_params.layerkv_endpoint{extra}. Start it with --kv-transfer-config "
                f"'{{\"kv_connector\": \"LayerKV\", \"kv_role\": \"kv_producer\"}}', or give the "
                f"endpoint explicitly as {backend.url}#kv=HOST:PORT"))
        try:
            host, port = parse_hostport(endpoint, f"layerkv_endpoint from {backend.url}")
        except ValueError as e:
            raise UpstreamError(backend, str(e)) from None
        url_host = urlsplit(backend.url).hostname or host
        if host in _UNSPECIFIED_HOSTS:
            # The connector listens on all interfaces: reach it where the HTTP server is.
            host = url_host
        elif host.startswith("127.") and not url_host.startswith("127.") \
                and url_host != "localhost":
            logger.warning("%s advertises LayerKV endpoint %s:%d on loopback; decode instances on "
                           "other hosts cannot reach it (set the connector's host / VLLM_HOST_IP)",
                           backend, host, port)
        return host, port

    # -- upstream requests --------------------------------------------------------------------

    async def _send(self, backend: Backend, path: str, payload: bytes, headers: dict[str, str],
                    allow_stream: bool) -> UpstreamReply | aiohttp.ClientResponse:
        """POST to a backend. Returns the open response if it is a 200 SSE stream (and
        allow_stream), else the fully read reply. Cancelling this closes the connection."""
        try:
            resp = await self.session.post(backend.url + path, data=payload, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            backend.mark_unreachable(f"{type(e).__name__}: {e}")
            raise UpstreamError(backend, f"{backend} is unreachable: {type(e).__name__}: "
                                f"{e}") from None
        backend.mark_reachable()
        handed_off = False
        try:
            if allow_stream and resp.status == 200 and resp.content_type == "text/event-stream":
                handed_off = True
                return resp
            body = await resp.read()
            return UpstreamReply(backend, resp.status, body, resp.headers.get(
                "Content-Type", "application/json"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise UpstreamError(backend, f"{backend} broke off its response: "
                                f"{type(e).__name__}: {e}") from None
        finally:
            if not handed_off:
                # After a full read this returns the connection to the pool; on cancellation or
                # error it closes the connection, which is what makes vLLM abort the request.
                if resp.content.is_eof():
                    resp.release()
                else:
                    resp.close()

    async def _finish_prefill_later(self, task: asyncio.Task[Any], tid: str) -> None:
        try:
            res = await asyncio.wait_for(asyncio.shield(task), PREFILL_GRACE_S)
        except asyncio.TimeoutError:
            logger.warning("transfer %s: prefill still running %.0f s after decode finished; "
                           "cancelling it", tid, PREFILL_GRACE_S)
            await _cancel_and_wait([task])
            return
        except asyncio.CancelledError:
            await _cancel_and_wait([task])
            raise
        except Exception as e:  # already answered the client; just record it
            logger.warning("transfer %s: prefill failed after decode finished: %s", tid, e)
            return
        if isinstance(res, UpstreamReply) and res.status != 200:
            logger.warning("transfer %s: prefill answered HTTP %d after decode finished: %s",
                           tid, res.status, res.body[:300])

    def _in_background(self, task: asyncio.Task[Any], tid: str) -> None:
        if task.done():
            if not task.cancelled() and task.exception() is not None:  # retrieve, and record
                logger.warning("transfer %s: prefill failed after decode finished: %s", tid,
                               task.exception())
            return
        bg = asyncio.create_task(self._finish_prefill_later(task, tid))
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    @staticmethod
    def _prefill_failure(task: asyncio.Task[Any]) -> UpstreamReply | UpstreamError | None:
        """The failure of a finished prefill task, or None if P answered 200."""
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, UpstreamError):
                return exc
            raise exc
        reply = task.result()
        return None if reply.status == 200 else reply

    # -- HTTP handlers ------------------------------------------------------------------------

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, chat=True)

    async def _handle_generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        body = parse_request_body(raw, chat)
        tid = uuid.uuid4().hex
        if needs_prompt_logprobs(body, chat):
            return await self._serve_prefill_only(request, raw, tid)
        if self.first_token_from_prefill:
            why_not = ineligible(body, chat)
            if why_not is None:
                return await self._serve_pd(request, body, chat, tid, first_token=True)
            logger.debug("request %s: D makes the first token itself: %s", tid, why_not)
        return await self._serve_pd(request, body, chat, tid)

    async def _serve_prefill_only(self, request: web.Request, raw: bytes, tid: str
                                  ) -> web.StreamResponse:
        """Prompt-logprob requests: P computes the prompt's logits, D never does."""
        lease = self.prefill.pick()
        p = lease.backend
        logger.debug("request %s: prompt logprobs -> prefill-only P=%s", tid, p.url)
        task = asyncio.create_task(self._send(p, request.path, raw,
                                              self._upstream_headers(request, tid), True))
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
            return await self._await_relay(relay, relay_task, tid)
        finally:
            await _cancel_and_wait([task, relay_task])
            lease.release()

    async def _await_relay(self, relay: StreamRelay, relay_task: asyncio.Task[None], tid: str
                           ) -> web.StreamResponse:
        """Outcome of a finished relay as the handler's return value."""
        try:
            await relay_task
        except ClientGone:
            logger.debug("request %s: client disconnected", tid)
        except UpstreamError as e:
            if relay.response is None:
                return e.response({"X-Request-Id": tid})
            await relay.finish_with_error(502, str(e), "bad_gateway")
        assert relay.response is not None
        return relay.response

    async def _serve_pd(self, request: web.Request, body: dict[str, Any], chat: bool, tid: str,
                        first_token: bool = False) -> web.StreamResponse:
        """Pick P and D, and hold each until that instance is done with the request: D until
        its answer is relayed (or cut off), P until its own request ends, which may be after
        the handler returns (``_in_background``)."""
        p_lease, d_lease = self.prefill.pick(), self.decode.pick()
        try:
            return await self._serve_pd_on(p_lease, d_lease.backend, request, body, chat, tid,
                                           first_token)
        finally:
            d_lease.release()
            if p_lease.task is None:  # returned before P was asked
                p_lease.release()

    async def _serve_pd_on(self, p_lease: Lease, d: Backend, request: web.Request,
                           body: dict[str, Any], chat: bool, tid: str, first_token: bool
                           ) -> web.StreamResponse:
        """One P/D request on the chosen instances."""
        p = p_lease.backend
        await self.wait_ready()  # no-op once start-up discovery is over
        try:
            host, port = await self.kv_endpoint(p)
        except UpstreamError as e:
            return e.response({"X-Request-Id": tid})
        logger.debug("request %s: P=%s D=%s (LayerKV %s:%d) path=%s stream=%s", tid, p.url,
                     d.url, host, port, request.path, bool(body.get("stream")))
        if isinstance(body.get("kv_transfer_params"), dict):
            logger.debug("request %s: client's kv_transfer_params replaced", tid)

        headers = self._upstream_headers(request, tid)
        out_headers = {"X-Request-Id": tid}
        self.tracer.event("proxy_in", transfer_id=tid)
        # Both in flight at once: D registers with P while P prefills (see module docstring).
        p_task = asyncio.create_task(self._send(
            p, request.path, encode_json(prefill_body(body, tid, chat, first_token)), headers,
            False))
        p_lease.end_with(p_task)
        d_task = asyncio.create_task(self._send(
            d, request.path, encode_json(decode_body(body, tid, host, port, first_token)),
            headers, True))
        if first_token:
            try:
                return await self._answer_from_prefill_first(request, body, tid, d, p_task,
                                                             d_task)
            except ClientGone:
                logger.debug("request %s: client disconnected", tid)
                return web.Response(status=499)  # nobody reads it
            finally:
                self.tracer.event("proxy_out", transfer_id=tid)
                self.tracer.flush()
                await _cancel_and_wait([p_task, d_task])
                _close_unrelayed(d_task)
        relay_task: asyncio.Task[None] | None = None
        keep_prefill = False  # True once D has succeeded: P may finish in the background
        try:
            # Phase 1: until D answers (headers of a stream, or a whole JSON body), watch P.
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while d_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done:
                    failure = self._prefill_failure(p_task)
                    if failure is not None and not (d_task in done and _answered_ok(d_task)):
                        logger.debug("request %s: prefill failed, cancelling decode", tid)
                        return failure.response(out_headers)
            try:
                d_res = d_task.result()
            except UpstreamError as e:
                return e.response(out_headers)
            if isinstance(d_res, UpstreamReply):
                if d_res.status == 200:
                    keep_prefill = True
                else:
                    logger.debug("request %s: decode answered HTTP %d, cancelling prefill",
                                 tid, d_res.status)
                return d_res.response(out_headers)

            # Phase 2: D streams. Relay it while still watching P: if P fails, D would only
            # wait for KV that never comes, so the stream is ended with P's error.
            relay = StreamRelay(request, d_res, d, out_headers, on_first=(
                (lambda: self.tracer.event("proxy_d_first", transfer_id=tid))
                if self.tracer.enabled else None))
            relay_task = asyncio.create_task(relay.run())
            pending = {relay_task} | ({p_task} if not p_task.done() else set())
            while relay_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done:
                    failure = self._prefill_failure(p_task)
                    if failure is not None:
                        await _cancel_and_wait([relay_task])
                        logger.debug("request %s: prefill failed mid-stream, cancelling decode",
                                     tid)
                        if relay.response is None:
                            return failure.response(out_headers)
                        if isinstance(failure, UpstreamReply):
                            msg, type_ = failure.error_message()
                            await relay.finish_with_error(failure.status, f"prefill failed: {msg}",
                                                          type_)
                        else:
                            await relay.finish_with_error(failure.status, str(failure),
                                                          "bad_gateway")
                        return relay.response
            keep_prefill = relay_task.exception() is None
            return await self._await_relay(relay, relay_task, tid)
        finally:
            self.tracer.event("proxy_out", transfer_id=tid)
            self.tracer.flush()
            # Runs on every exit, including cancellation when the client disconnects.
            if keep_prefill:
                self._in_background(p_task, tid)
                await _cancel_and_wait([d_task, relay_task])
            else:
                await _cancel_and_wait([p_task, d_task, relay_task])

    async def _answer_from_prefill_first(self, request: web.Request, body: dict[str, Any],
                                         tid: str, d: Backend, p_task: asyncio.Task[Any],
                                         d_task: asyncio.Task[Any]) -> web.StreamResponse:
        """first_token_from_prefill: P's token is the client's first token, D's answer the rest
        (D's connector appends P's token to D's prompt). P answers first: D needs P's KV and
        token before it can make anything."""
        out_headers = {"X-Request-Id": tid}
        pending: set[asyncio.Task[Any]] = {p_task, d_task}
        while p_task in pending:  # until P answers; D failing first fails the request
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if d_task in done and p_task in pending:
                try:
                    d_res = d_task.result()
                except UpstreamError as e:
                    return e.response(out_headers)
                if isinstance(d_res, UpstreamReply) and d_res.status != 200:
                    return d_res.response(out_headers)
        failure = self._prefill_failure(p_task)
        if failure is not None:
            return failure.response(out_headers)
        try:
            first = PrefillToken.parse(p_task.result().body)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return UpstreamError(None, f"prefill answer without a token: {e}").response(
                out_headers)
        self.tracer.event("proxy_p_token", transfer_id=tid)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if first.ends_answer:  # P stopped at its token: D (cancelled on return) adds nothing
            if not stream:
                return web.Response(body=first.as_answer(), headers={
                    "Content-Type": "application/json", **out_headers})
            response = await open_stream(request, 200, "text/event-stream", out_headers)
            try:
                await response.write(first.first_chunk(final=True) +
                                     first.final_events(include_usage))
            except (ConnectionError, RuntimeError):
                pass  # the client is gone
            return response
        if not stream:
            try:
                d_res = await d_task
            except UpstreamError as e:
                return e.response(out_headers)
            assert isinstance(d_res, UpstreamReply)
            if d_res.status != 200:
                return d_res.response(out_headers)
            return web.Response(body=first.merge_reply(d_res.body), headers={
                "Content-Type": "application/json", **out_headers})

        response = await open_stream(request, 200, "text/event-stream", out_headers)
        try:
            await response.write(first.first_chunk(final=False))
        except (ConnectionError, RuntimeError):
            return response  # the client is gone; D is cancelled on return
        try:
            d_res = await d_task
        except UpstreamError as e:
            d_res = UpstreamReply(e.backend, e.status, encode_json({"error": {
                "message": str(e), "type": "bad_gateway"}}), "application/json")
        if isinstance(d_res, UpstreamReply):  # D answered with an error after P's token
            msg, type_ = d_res.error_message()
            await StreamRelay.finish(response, d_res.status, f"decode failed: {msg}", type_)
            return response
        relay = StreamRelay(request, d_res, d, out_headers, response=response,
                            edit=UsagePlusOne())
        relay_task = asyncio.create_task(relay.run())
        try:
            return await self._await_relay(relay, relay_task, tid)
        finally:
            await _cancel_and_wait([relay_task])

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        lease = self.decode.pick()
        d = lease.backend
        try:
            async with self.session.get(d.url + "/v1/models",
                                        headers=self._upstream_headers(request, None)) as r:
                body = await r.read()
                return web.Response(status=r.status, body=body, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            d.mark_unreachable(f"{type(e).__name__}: {e}")
            raise UpstreamError(d, f"{d} is unreachable: {type(e).__name__}: {e}") from None
        finally:
            lease.release()

    def _rediscover(self, backend: Backend) -> None:
        """Retry a failed discovery without waiting for it (one attempt at a time)."""
        if backend.discover_lock.locked():
            return

        async def attempt() -> None:
            try:
                await self.kv_endpoint(backend)
            except UpstreamError as e:
                logger.debug("%s: discovery retried from /health: %s", backend, e)

        task = asyncio.create_task(attempt())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def handle_health(self, request: web.Request) -> web.StreamResponse:
        backends = self.all_backends()
        results = await asyncio.gather(*(self.check_health(b) for b in backends))
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
                    self._rediscover(b)
            report[b.role][b.url] = entry
            if not ok:
                failing.append(f"{b} ({detail})")
        if failing:
            return web.json_response({
                "status": "unhealthy", "failing": failing,
                "message": "unhealthy backends: " + "; ".join(failing), **report}, status=503)
        return web.json_response({"status": "ok", **report})


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The handler boundary: every error becomes an OpenAI-style JSON error, never a traceback."""
    try:
        return await handler(request)
    except BadRequest as e:
        return e.response()
    except UpstreamError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            msg = (f"no route {request.method} {request.path}; the proxy serves POST "
                   f"{COMPLETIONS_PATH}, POST {CHAT_PATH}, GET /v1/models and GET /health")
        else:
            msg = f"{e.reason}: {request.method} {request.path}"
            if e.status == 413:
                msg += f" (request bodies are limited to {MAX_REQUEST_BYTES} bytes)"
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, msg, "invalid_request_error", headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("internal error while serving %s %s", request.method, request.path)
        return error_response(500, "internal proxy error (details are in the proxy's log)",
                              "internal_server_error")


PROXY_KEY = web.AppKey("layerkv_proxy", ProxyApp)


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
              startup_timeout: float = 600.0, connect_timeout: float = 10.0,
              api_key: str | None = None, trace_path: str = "",
              first_token_from_prefill: bool = False, routing: str = "least-loaded"
              ) -> web.Application:
    """The proxy as an aiohttp application (``app[PROXY_KEY]`` is its ProxyApp).

    Run it with ``handler_cancellation=True`` (``run_proxy`` and aiohttp's TestServer do) so a
    client disconnect cancels the handler and with it both upstream requests.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    prefill = [parse_backend_url(u, "prefill") for u in prefill_urls]
    decode = [parse_backend_url(u, "decode") for u in decode_urls]
    proxy = ProxyApp(prefill, decode, startup_timeout=startup_timeout,
                     connect_timeout=connect_timeout, api_key=api_key, trace_path=trace_path,
                     first_token_from_prefill=first_token_from_prefill, routing=routing)
    app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_REQUEST_BYTES)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    app.router.add_post(COMPLETIONS_PATH, proxy.handle_completions)
    app.router.add_post(CHAT_PATH, proxy.handle_chat)
    app.router.add_get("/v1/models", proxy.handle_models)
    app.router.add_get("/health", proxy.handle_health)
    return app


def run_proxy(args: Any) -> None:
    """Serve until interrupted. ``args``: prefill, decode (lists of URLs), host, port, timeout.

    The backends' API key, if any, is taken from ``VLLM_API_KEY`` (what ``vllm serve`` reads)
    and used for discovery; client requests carry their own Authorization header through.
    """
    app = build_app(args.prefill, args.decode, startup_timeout=args.timeout,
                    api_key=os.environ.get("VLLM_API_KEY") or None,
                    trace_path=getattr(args, "trace", "") or "",
                    first_token_from_prefill=bool(getattr(args, "first_token_from_prefill",
                                                          False)),
                    routing=getattr(args, "routing", "least-loaded"))
    proxy = app[PROXY_KEY]
    logger.info("LayerKV proxy on http://%s:%d  prefill: %s  decode: %s  routing: %s", args.host,
                args.port, " ".join(b.url for b in proxy.prefill.items),
                " ".join(b.url for b in proxy.decode.items), proxy.prefill.policy)
    # access_log=None: one access line per request would cost real time at benchmark rates;
    # requests are logged at DEBUG with their transfer_id instead.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                access_log=None, print=None)

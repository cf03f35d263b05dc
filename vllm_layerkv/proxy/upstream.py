"""The proxy's HTTP client to its backends: one pool of connections, the headers upstream
requests carry, and the POST that hands back either a complete reply or an open stream.

Credentials: a client's request goes upstream with the client's own ``Authorization`` header,
or with none. The backends' API key (``VLLM_API_KEY``) is only ever sent on the proxy's own
requests (discovery, health checks): lending it to clients would let anyone who reaches the
proxy past the backends' ``--api-key``."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from vllm_layerkv.proxy.backends import Backend
from vllm_layerkv.proxy.errors import UpstreamError, UpstreamReply

# vLLM's HTTP server (uvicorn) closes idle keep-alive connections after 5 s by default. A pooled
# client connection that is reused just as the server closes it fails the POST (aiohttp does not
# retry non-idempotent requests), so pooled connections are dropped a little earlier than that.
UPSTREAM_KEEPALIVE_S = 3.0


class Upstream:
    """The pooled HTTP client (``open`` on start-up, ``close`` on clean-up)."""

    def __init__(self, connect_timeout: float, backend_api_key: str | None) -> None:
        self.connect_timeout = connect_timeout
        self._backend_api_key = backend_api_key
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Create the pooled client; call from the running event loop."""
        # No total timeout: a streamed generation may run for minutes. Only establishing a
        # connection is bounded, so a dead backend fails fast.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "upstream client used outside a running aiohttp app"
        return self._session

    def client_headers(self, request: web.Request, request_id: str | None) -> dict[str, str]:
        """Headers of a client's request to a backend: the client's ``Authorization`` if it
        sent one (never the backends' key), and the transfer_id as ``X-Request-Id`` so that the
        backends' logs line up."""
        headers = {"Content-Type": "application/json"}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    def own_headers(self, request_id: str | None) -> dict[str, str]:
        """Headers of the proxy's own requests (discovery, health checks): the backends' API
        key, if any."""
        headers = {"Content-Type": "application/json"}
        if self._backend_api_key:
            headers["Authorization"] = f"Bearer {self._backend_api_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    async def post(self, backend: Backend, path: str, payload: bytes, headers: dict[str, str],
                   allow_stream: bool) -> UpstreamReply | aiohttp.ClientResponse:
        """POST to a backend. Returns the open response if it is a 200 SSE stream (and
        allow_stream), else the fully read reply. Cancelling this closes the connection."""
        try:
            resp = await self.session.post(backend.url + path, data=payload, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            backend.mark_unreachable(f"{type(e).__name__}: {e}")
            raise unreachable(backend, e) from None
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
            raise broke_off(backend, e) from None
        finally:
            if not handed_off:
                # After a full read this returns the connection to the pool; on cancellation or
                # error it closes the connection, which is what makes vLLM abort the request.
                if resp.content.is_eof():
                    resp.release()
                else:
                    resp.close()


def unreachable(backend: Backend, e: BaseException) -> UpstreamError:
    """The error of a request that could not reach ``backend``."""
    return UpstreamError(backend, f"{backend.name} is unreachable ({type(e).__name__})",
                         f"{backend} is unreachable: {type(e).__name__}: {e}")


def broke_off(backend: Backend, e: BaseException) -> UpstreamError:
    """The error of a response that ``backend`` did not finish."""
    return UpstreamError(backend, f"{backend.name} broke off its response ({type(e).__name__})",
                         f"{backend} broke off its response: {type(e).__name__}: {e!r}")

"""The proxy as an aiohttp application: its parts wired together (``ProxyApp``), its routes,
the error boundary every handler runs inside, and ``run_proxy`` (the request flow is in the
package docstring, ``vllm_layerkv/proxy/__init__.py``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.proxy.backends import Backend, parse_backend_url
from vllm_layerkv.proxy.bodies import CHAT_PATH, COMPLETIONS_PATH
from vllm_layerkv.proxy.config import ProxyConfig
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.errors import BadRequest, UpstreamError, error_response
from vllm_layerkv.proxy.health import Health
from vllm_layerkv.proxy.orchestration import Orchestrator
from vllm_layerkv.proxy.routing import Router, Routers
from vllm_layerkv.proxy.startup import Startup
from vllm_layerkv.proxy.tasks import BackgroundTasks, cancel_and_wait
from vllm_layerkv.proxy.upstream import Upstream

logger = init_logger(__name__)

# Prompts can be long (and chat requests may carry base64 images): aiohttp's default 1 MiB
# request-body limit would reject legitimate long-context benchmark requests.
MAX_REQUEST_BYTES = 256 * 1024 * 1024


class ProxyApp:
    """One proxy: its backends' routers, the HTTP client, discovery, health, start-up and the
    request handlers, wired together."""

    def __init__(self, prefill: Sequence[Backend], decode: Sequence[Backend],
                 config: ProxyConfig = ProxyConfig()) -> None:
        self.config = config
        self.routers = Routers(Router(prefill, config.routing), Router(decode, config.routing))
        self.upstream = Upstream(config.connect_timeout, config.api_key)
        self.background = BackgroundTasks()
        self.discovery = Discovery(self.upstream, self.background)
        self.health = Health(self.upstream, self.routers, self.discovery)
        self.startup = Startup(self.routers, self.health, self.discovery, config.startup_timeout)
        self.orchestrator = Orchestrator(
            routers=self.routers, upstream=self.upstream, discovery=self.discovery,
            startup=self.startup, background=self.background,
            tracer=Tracer(config.trace_path, "proxy", 0),
            first_token_from_prefill=config.first_token_from_prefill)

    @property
    def prefill(self) -> Router:
        return self.routers.prefill

    @property
    def decode(self) -> Router:
        return self.routers.decode

    async def on_startup(self, app: web.Application) -> None:
        self.upstream.open()
        # Start-up runs in the background so the proxy answers /health while backends boot.
        self.startup.begin()

    async def on_cleanup(self, app: web.Application) -> None:
        await cancel_and_wait([self.startup.task, *self.background.tasks])
        await self.upstream.close()

    async def wait_ready(self) -> None:
        """Return once start-up (health wait + discovery) is over, successful or not."""
        await self.startup.wait()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(COMPLETIONS_PATH, self.orchestrator.handle_completions)
        app.router.add_post(CHAT_PATH, self.orchestrator.handle_chat)
        app.router.add_get("/v1/models", self.orchestrator.handle_models)
        app.router.add_get("/health", self.health.handle)


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
    proxy = ProxyApp(prefill, decode, ProxyConfig(
        startup_timeout=startup_timeout, connect_timeout=connect_timeout, api_key=api_key,
        trace_path=trace_path, first_token_from_prefill=first_token_from_prefill,
        routing=routing))
    app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_REQUEST_BYTES)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    proxy.add_routes(app)
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

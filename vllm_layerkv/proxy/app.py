"""The proxy as an aiohttp application: its parts wired together (``ProxyApp``), its routes
and middlewares (the head deadline, the error boundary every handler runs inside, admission),
``start_proxy`` for in-process use and ``run_proxy`` for the command line (the request flow is
in the package docstring, ``vllm_layerkv/proxy/__init__.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Mapping, Sequence

from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.proxy.admission import Admission
from vllm_layerkv.proxy.auth import ADMIN_KEY_ENV, API_KEY_ENV, BearerKeys
from vllm_layerkv.proxy.backends import Backend, parse_backend_url
from vllm_layerkv.proxy.bodies import CHAT_PATH, COMPLETIONS_PATH
from vllm_layerkv.proxy.body_reader import too_large
from vllm_layerkv.proxy.config import ProxyConfig
from vllm_layerkv.proxy.discovery import Discovery
from vllm_layerkv.proxy.errors import Refused, UpstreamError, error_response
from vllm_layerkv.proxy.event_loop import loop_factory
from vllm_layerkv.proxy.health import Health
from vllm_layerkv.proxy.orchestration import Orchestrator
from vllm_layerkv.proxy.routing import Router, Routers
from vllm_layerkv.proxy.server import (
    HeadDeadline,
    ProxyServer,
    raise_open_file_limit,
    serve_until_signalled,
)
from vllm_layerkv.proxy.startup import Startup
from vllm_layerkv.proxy.tasks import BackgroundTasks, cancel_and_wait
from vllm_layerkv.proxy.upstream import Upstream

logger = init_logger(__name__)

BACKEND_API_KEY_ENV = "VLLM_API_KEY"
"""What ``vllm serve`` reads its key from; the proxy sends it on its own requests only."""


class ProxyApp:
    """One proxy: its backends' routers, the HTTP client, discovery, health, start-up, the
    admission of requests and the request handlers, wired together."""

    def __init__(self, prefill: Sequence[Backend], decode: Sequence[Backend],
                 config: ProxyConfig = ProxyConfig()) -> None:
        self.config = config
        self.routers = Routers(Router(prefill, config.routing), Router(decode, config.routing))
        self.upstream = Upstream(config.connect_timeout, config.backend_api_key)
        self.background = BackgroundTasks()
        self.discovery = Discovery(self.upstream, self.background)
        self.health = Health(self.upstream, self.routers, self.discovery, self.background,
                             BearerKeys([config.admin_key] if config.admin_key else []))
        self.startup = Startup(self.routers, self.health, self.discovery, config.startup_timeout)
        self.admission = Admission(BearerKeys(config.api_keys), config.max_concurrent_requests)
        self.heads = HeadDeadline(config.header_timeout)
        self.orchestrator = Orchestrator(
            routers=self.routers, upstream=self.upstream, discovery=self.discovery,
            startup=self.startup, background=self.background,
            tracer=Tracer(config.trace_path, "proxy", 0), config=config)

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
    except Refused as e:
        return e.response()
    except UpstreamError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:  # the body read by aiohttp itself (not the proxy's routes)
            return too_large(request.app[PROXY_KEY].config.max_body_bytes).response()
        if e.status == 404:
            msg = (f"no route {request.method} {request.path}; the proxy serves POST "
                   f"{COMPLETIONS_PATH}, POST {CHAT_PATH}, GET /v1/models and GET /health")
        else:
            msg = f"{e.reason}: {request.method} {request.path}"
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, msg, "invalid_request_error", headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("internal error while serving %s %s", request.method, request.path)
        return error_response(500, "internal proxy error (details are in the proxy's log)",
                              "internal_server_error")


PROXY_KEY = web.AppKey("layerkv_proxy", ProxyApp)


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
              config: ProxyConfig | None = None, **settings: Any) -> web.Application:
    """The proxy as an aiohttp application (``app[PROXY_KEY]`` is its ProxyApp). ``settings``
    are ProxyConfig fields, applied over ``config`` (e.g. ``startup_timeout=5.0``).

    Serve it with ``start_proxy`` (or ``run_proxy``): they add the deadline on request heads
    and cancel the handler, and with it both upstream requests, when a client disconnects.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    config = dataclasses.replace(config or ProxyConfig(), **settings)
    prefill = [parse_backend_url(u, "prefill", i) for i, u in enumerate(prefill_urls)]
    decode = [parse_backend_url(u, "decode", i) for i, u in enumerate(decode_urls)]
    proxy = ProxyApp(prefill, decode, config)
    # Middlewares, outermost first: the head deadline ends once a request starts; errors
    # become JSON answers; admission refuses requests from their head alone.
    app = web.Application(
        middlewares=[proxy.heads.middleware, _error_middleware, proxy.admission.middleware],
        client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    proxy.add_routes(app)
    return app


async def start_proxy(app: web.Application, host: str = "127.0.0.1", port: int = 0
                      ) -> ProxyServer:
    """Serve ``app`` (``build_app``) on host:port (0: a free port, ``ProxyServer.port``) until
    ``ProxyServer.close``."""
    proxy = app[PROXY_KEY]
    return await ProxyServer.start(app, proxy.heads, host, port,
                                   proxy.config.max_concurrent_requests)


def config_from_args(args: Any, environ: Mapping[str, str] = os.environ) -> ProxyConfig:
    """The ``vllm-layerkv proxy`` options (cli.py) as a ProxyConfig. Keys not given as options
    come from the environment: the clients' from ``LAYERKV_PROXY_API_KEY``, the admin's from
    ``LAYERKV_PROXY_ADMIN_KEY``; the backends' always from ``VLLM_API_KEY``."""
    api_keys = tuple(getattr(args, "api_key", None) or ())
    if not api_keys and environ.get(API_KEY_ENV):
        api_keys = (environ[API_KEY_ENV],)
    defaults = ProxyConfig()
    return ProxyConfig(
        startup_timeout=args.timeout,
        backend_api_key=environ.get(BACKEND_API_KEY_ENV) or None,
        api_keys=api_keys,
        admin_key=getattr(args, "admin_key", None) or environ.get(ADMIN_KEY_ENV) or None,
        max_body_bytes=getattr(args, "max_body_bytes", defaults.max_body_bytes),
        max_concurrent_requests=getattr(args, "max_concurrent_requests",
                                        defaults.max_concurrent_requests),
        header_timeout=getattr(args, "header_timeout", defaults.header_timeout),
        body_timeout=getattr(args, "body_timeout", defaults.body_timeout),
        max_json_depth=getattr(args, "max_json_depth", defaults.max_json_depth),
        trace_path=getattr(args, "trace", "") or "",
        first_token_from_prefill=bool(getattr(args, "first_token_from_prefill", False)),
        routing=getattr(args, "routing", defaults.routing))


def run_proxy(args: Any) -> None:
    """Serve until interrupted. ``args``: prefill, decode (lists of URLs), host, port, timeout,
    and the other ``vllm-layerkv proxy`` options (``config_from_args``). A bad setting exits
    with a message naming the option."""
    try:
        app = build_app(args.prefill, args.decode, config_from_args(args))
        loop_name, new_loop = loop_factory(getattr(args, "event_loop", "auto"))
    except ValueError as e:
        raise SystemExit(f"vllm-layerkv proxy: {e}") from None
    proxy = app[PROXY_KEY]
    config = proxy.config
    logger.info("LayerKV proxy on http://%s:%d  prefill: %s  decode: %s  routing: %s  event "
                "loop: %s", args.host, args.port, " ".join(b.url for b in proxy.prefill.items),
                " ".join(b.url for b in proxy.decode.items), proxy.prefill.policy, loop_name)
    logger.info("client keys: %s; admin key: %s; backend key (own requests only): %s; "
                "limits: body %d bytes, %d concurrent requests, head %g s, body %g s, JSON "
                "depth %d", "on" if config.api_keys else "off",
                "on" if config.admin_key else "off",
                "on" if config.backend_api_key else "off", config.max_body_bytes,
                config.max_concurrent_requests, config.header_timeout, config.body_timeout,
                config.max_json_depth)
    if not config.api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving %s without --api-key: anyone who reaches the proxy can send "
                       "requests to the backends", args.host)
    raise_open_file_limit(config.max_concurrent_requests)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(serve_until_signalled(app, proxy.heads, args.host, args.port,
                                         config.max_concurrent_requests))

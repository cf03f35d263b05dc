"""Discovery of each prefill instance's LayerKV endpoint, the address D registers with (not the
HTTP port: by default the connector picks a free port).

The proxy asks the instance: it fetches a model id from ``GET /v1/models`` and sends a 1-token
completion with ``kv_transfer_params={"layerkv_discover": true}``; the connector answers with
``kv_transfer_params={"layerkv_endpoint": "HOST:PORT", ...}``. The endpoint is cached on the
``Backend``; one given as ``#kv=HOST:PORT`` in the URL is never asked for. A failed discovery
is kept as the instance's ``discovery_error`` (in full, for the log and the detailed
``/health``) and ``discovery_failure`` (without URLs or the backend's answer, for clients), and
retried on the next request that picks the instance, or from ``/health`` in the background.

Discovery is the proxy's own request: it carries the backends' API key (``VLLM_API_KEY``). A
client can never ask for it: the proxy removes any ``kv_transfer_params`` a client sends
(bodies.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from urllib.parse import urlsplit

import aiohttp

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.backends import Backend, parse_hostport
from vllm_layerkv.proxy.bodies import COMPLETIONS_PATH
from vllm_layerkv.proxy.errors import UpstreamError, encode_json
from vllm_layerkv.proxy.tasks import BackgroundTasks
from vllm_layerkv.proxy.upstream import Upstream

logger = init_logger(__name__)

DISCOVERY_TIMEOUT_S = 120.0

_UNSPECIFIED_HOSTS = {"", "0.0.0.0", "::", "[::]"}


class Discovery:
    """Each prefill instance's LayerKV endpoint: cached, else asked for."""

    def __init__(self, upstream: Upstream, background: BackgroundTasks) -> None:
        self.upstream = upstream
        self.background = background

    async def kv_endpoint(self, backend: Backend) -> tuple[str, int]:
        """The LayerKV endpoint of a prefill instance: cached, else discovered now."""
        if backend.kv_endpoint is not None:
            return backend.kv_endpoint
        async with backend.discover_lock:  # one probe at a time per instance
            if backend.kv_endpoint is None:
                try:
                    backend.kv_endpoint = await self._discover(backend)
                except UpstreamError as e:
                    backend.discovery_error, backend.discovery_failure = e.detail, str(e)
                    raise
                backend.discovery_error = backend.discovery_failure = None
                logger.info("%s: LayerKV endpoint %s:%d (discovered)", backend,
                            *backend.kv_endpoint)
            return backend.kv_endpoint

    def retry_in_background(self, backend: Backend) -> None:
        """Retry a failed discovery without waiting for it (one attempt at a time)."""
        if backend.discover_lock.locked():
            return

        async def attempt() -> None:
            try:
                await self.kv_endpoint(backend)
            except UpstreamError as e:
                logger.debug("%s: discovery retried from /health: %s", backend, e)

        self.background.spawn(attempt())

    async def _discover(self, backend: Backend) -> tuple[str, int]:
        headers = self.upstream.own_headers(f"layerkv-discover-{uuid.uuid4().hex}")
        try:
            model = await self._model_id(backend, headers)
            answer = await self._probe(backend, model, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise UpstreamError(
                backend, f"LayerKV discovery: {backend.name} is unreachable "
                f"({type(e).__name__})",
                f"LayerKV discovery: {backend} is unreachable: {type(e).__name__}: {e}"
            ) from None
        host, port = _advertised_endpoint(backend, answer)
        return _reachable_endpoint(backend, host, port)

    async def _model_id(self, backend: Backend, headers: dict[str, str]) -> str:
        """The first model id of ``GET /v1/models``, for the probe's body."""
        async with self.upstream.session.get(
                backend.url + "/v1/models", headers=headers,
                timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S)) as r:
            text = await r.text(errors="replace")
            if r.status != 200:
                raise UpstreamError(
                    backend, f"LayerKV discovery: {backend.name} answered GET /v1/models with "
                    f"HTTP {r.status}",
                    f"LayerKV discovery: GET {backend.url}/v1/models answered HTTP "
                    f"{r.status}: {text[:500]}")
        try:
            return json.loads(text)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise UpstreamError(
                backend, f"LayerKV discovery: {backend.name} listed no model in GET /v1/models",
                f"LayerKV discovery: GET {backend.url}/v1/models returned no model id: "
                f"{text[:500]}") from None

    async def _probe(self, backend: Backend, model: str, headers: dict[str, str]) -> str:
        """The instance's answer (text) to the 1-token discovery completion."""
        probe = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0,
                 "kv_transfer_params": {"layerkv_discover": True}}
        async with self.upstream.session.post(
                backend.url + COMPLETIONS_PATH, data=encode_json(probe), headers=headers,
                timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S)) as r:
            text = await r.text(errors="replace")
            if r.status != 200:
                raise UpstreamError(
                    backend, f"LayerKV discovery: {backend.name} answered the probe with HTTP "
                    f"{r.status}",
                    f"LayerKV discovery probe to {backend.url}{COMPLETIONS_PATH} answered HTTP "
                    f"{r.status}: {text[:500]}")
        return text


def _advertised_endpoint(backend: Backend, answer: str) -> tuple[str, int]:
    """``kv_transfer_params.layerkv_endpoint`` of the probe's answer; an UpstreamError that
    says how to start the instance when it has none."""
    try:
        kv = json.loads(answer).get("kv_transfer_params") or {}
    except (ValueError, AttributeError):
        kv = {}
    endpoint = kv.get("layerkv_endpoint") if isinstance(kv, dict) else None
    if not endpoint or not isinstance(endpoint, str):
        extra = (f" (connector said: {kv['layerkv_error']})"
                 if isinstance(kv, dict) and kv.get("layerkv_error") else "")
        remedy = ("Start it with --kv-transfer-config '{\"kv_connector\": \"LayerKV\", "
                  "\"kv_role\": \"kv_producer\"}', or give the endpoint explicitly")
        raise UpstreamError(
            backend, f"{backend.name} does not run the LayerKV connector as kv_producer: its "
            f"answer to the discovery probe has no kv_transfer_params.layerkv_endpoint. "
            f"{remedy} by appending #kv=HOST:PORT to its URL in --prefill",
            f"prefill instance {backend.url} does not run the LayerKV connector as "
            f"kv_producer: its answer to the discovery probe has no "
            f"kv_transfer_params.layerkv_endpoint{extra}. {remedy} as "
            f"{backend.url}#kv=HOST:PORT")
    try:
        return parse_hostport(endpoint, f"layerkv_endpoint from {backend.url}")
    except ValueError as e:
        raise UpstreamError(backend, f"LayerKV discovery: {backend.name} advertises an invalid "
                            "layerkv_endpoint", str(e)) from None


def _reachable_endpoint(backend: Backend, host: str, port: int) -> tuple[str, int]:
    """The advertised endpoint as decode instances reach it: an unspecified host becomes the
    host of the instance's URL; a loopback one is only warned about."""
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

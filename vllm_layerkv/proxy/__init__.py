"""OpenAI-compatible prefill/decode (P/D) proxy for LayerKV, built on aiohttp.

Flow of one ``/v1/completions`` or ``/v1/chat/completions`` request::

    client ──► proxy ──┬──► prefill P   body + max_tokens=1, stream=false,
                       │                kv_transfer_params={do_remote_decode, transfer_id}
                       └──► decode  D   body unchanged +
                                        kv_transfer_params={do_remote_prefill, transfer_id,
                                                            remote_host, remote_port}
    client ◄── D's response (status, JSON body, or the SSE stream chunk by chunk)

* P and D are picked independently of each other (any xPyD layout): by default the instance
  with the fewest requests in flight, ties in turn (``--routing``, routing.Router).
* Both upstream requests are sent **at the same time**. The LayerKV connector on D registers
  with P's LayerKV endpoint (``remote_host:remote_port``) as soon as D has scheduled the request,
  and P streams the KV layer group by layer group while it is still prefilling; waiting for P's
  answer before sending D would serialise exactly what LayerKV overlaps.
* ``transfer_id`` (a fresh uuid4 hex) is what P and D match the transfer on; it is also sent as
  ``X-Request-Id`` to both so that the backends' logs line up.
* If P fails, D's request is cancelled (closing its connection makes vLLM abort it) and P's
  error goes to the client; if D fails, P is cancelled and D's error goes to the client. If the
  client goes away, both upstream requests are cancelled.
* Requests that need prompt logprobs (``prompt_logprobs``, or ``echo`` + ``logprobs`` on
  ``/v1/completions``) cannot be served by D, which never computes the prompt's logits: they are
  sent unchanged to a prefill instance alone (lm-eval's loglikelihood tasks rely on this).
* Only the proxy writes ``kv_transfer_params``: a client's are removed on every path. A
  client's request carries the client's own ``Authorization`` header upstream, or none; the
  backends' key (``VLLM_API_KEY``) is for the proxy's own requests (discovery, health).
* Before any of this, a request is admitted from its head (``--api-key``, the concurrency
  limit) and its body read within limits (size, time, JSON depth): docs/security.md.

Discovery: the proxy learns each prefill instance's LayerKV endpoint by asking it. It fetches a
model id from ``GET /v1/models`` and sends a 1-token completion with
``kv_transfer_params={"layerkv_discover": true}``; the connector answers with
``kv_transfer_params={"layerkv_endpoint": "HOST:PORT", ...}`` in the response. The endpoint can
also be given explicitly as a URL fragment, ``http://p-host:8100#kv=HOST:PORT``.

Modules:

* ``app``: the aiohttp application (``build_app``, ``start_proxy``, ``run_proxy``): the parts
  wired together, the routes, the middlewares.
* ``config``: ``ProxyConfig``, the proxy's settings.
* ``server``: the listening socket, the deadline on request heads (``HeadDeadline``).
* ``admission``: the client key check and the concurrency limit.
* ``auth``: API keys, compared in constant time.
* ``body_reader``: the client's body, read within the size and time limits.
* ``backends``: a backend's URL checked, and what the proxy knows of each instance.
* ``routing``: the pick of P and D per request, the requests each instance has in flight.
* ``upstream``: the pooled HTTP client to the backends.
* ``discovery``: each prefill instance's LayerKV endpoint.
* ``health``: the backends' ``/health`` and the proxy's own.
* ``startup``: the health wait and discovery before the first request.
* ``orchestration``: the generation endpoints (transfer_id, P and D sent at once, prefill-only
  requests) and ``/v1/models``.
* ``exchange``: one P/D request in flight, and the client's answer made from it.
* ``first_token_exchange``: the same, answered with P's token first.
* ``bodies``: the client's body checked (UTF-8, JSON depth), its ``kv_transfer_params``
  removed, P's and D's derived.
* ``first_token``: what ``--first-token-from-prefill`` changes in bodies and answers.
* ``relay``: D's stream to the client.
* ``errors``: error answers.
* ``tasks``: cancelling upstream requests, tasks that outlive their handler.

See docs/proxy.md for usage.
"""

from vllm_layerkv.proxy.app import (
    PROXY_KEY,
    ProxyApp,
    build_app,
    config_from_args,
    run_proxy,
    start_proxy,
)
from vllm_layerkv.proxy.backends import Backend, parse_backend_url
from vllm_layerkv.proxy.bodies import (
    decode_body,
    needs_prompt_logprobs,
    parse_request_body,
    prefill_body,
    strip_transfer_params,
)
from vllm_layerkv.proxy.config import ProxyConfig
from vllm_layerkv.proxy.routing import ROUTING_POLICIES, Router
from vllm_layerkv.proxy.server import ProxyServer

__all__ = [
    "PROXY_KEY",
    "Backend",
    "ProxyApp",
    "ProxyConfig",
    "ProxyServer",
    "ROUTING_POLICIES",
    "Router",
    "build_app",
    "config_from_args",
    "decode_body",
    "needs_prompt_logprobs",
    "parse_backend_url",
    "parse_request_body",
    "prefill_body",
    "run_proxy",
    "start_proxy",
    "strip_transfer_params",
]

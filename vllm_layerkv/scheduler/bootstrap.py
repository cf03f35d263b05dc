"""The bootstrap endpoint: how a router, or a decode instance, finds a prefill instance's
LayerKV endpoint from nothing but its host.

It speaks the contract of vLLM's ``MooncakeConnector`` bootstrap server, which P/D routers
already use (``vllm-router --kv-connector mooncake``, llm-d's sidecar in ``mooncake`` mode):

* P serves ``GET /query`` on its bootstrap port (vLLM's default 8998). The answer maps each
  data-parallel rank to its engine: ``{"0": {"engine_id": E, "worker_addr": {"0": {"0": A}},
  "layerkv_endpoint": A}}``. Routers read ``engine_id`` and pass it to D as
  ``remote_engine_id``, with ``remote_bootstrap_addr = "http://P_HOST:PORT"``.
  ``layerkv_endpoint`` is the engine's registration endpoint (``host:port``); ``worker_addr``
  carries it too, in the shape vLLM's model (``{tp_rank: {pp_rank: addr}}``) declares.
* The engine core of data-parallel rank 0 serves the endpoint; the other ranks' engine cores
  ``POST /register`` their entry to it on the same host.
* D asks ``remote_bootstrap_addr + "/query"`` and takes the entry whose ``engine_id`` is
  ``remote_engine_id`` (``resolve``), from the registration client's thread.

With a LayerKV shared secret set, ``POST /register`` must carry the signed ``Authorization``
header of ``wire/auth.py`` (``register_with`` signs). ``GET /query`` is answered without it
unless ``bootstrap_query_auth`` is on: routers read it and do not sign, and its answer (engine
ids and registration endpoints) lets no one into a LayerKV channel without the secret. D signs
its own look-ups either way. The allowlist and the connection cap of ``wire/admission.py``
apply here too, and a request must arrive within ``handshake_timeout_s``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm_layerkv.common.backoff import Backoff
from vllm_layerkv.common.log import init_logger
from vllm_layerkv.common.threads import start_thread
from vllm_layerkv.wire.admission import Gate, ListenerLimits, Slot
from vllm_layerkv.wire.auth import AuthError, ChannelAuth, RequestVerifier, sign_request

logger = init_logger(__name__)
MAX_BODY_BYTES = 4096
"""A ``/register`` body is one small JSON object."""
SHUTDOWN_POLL_S = 0.05
"""How often the serving loop checks whether close() asked it to stop."""
REGISTER_RETRY_S = 60.0
"""How long a data-parallel rank keeps trying to register with rank 0's endpoint (rank 0's
engine core may start after it)."""


class BootstrapError(RuntimeError):
    """The bootstrap endpoint could not be served or asked; the message says what to change."""


def engine_entry(engine_id: str, endpoint: str) -> dict[str, Any]:
    return {"engine_id": engine_id, "worker_addr": {"0": {"0": endpoint}},
            "layerkv_endpoint": endpoint}


class _GatedHTTPServer(ThreadingHTTPServer):
    """One thread per connection, admitted by a ``Gate`` (allowlist, connection cap)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 gate: Gate):
        self.gate = gate
        self._slots: dict[int, Slot] = {}
        self._slots_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        slot = self.gate.admit(request, client_address)
        if slot is None:
            return  # the gate closed it
        with self._slots_lock:
            self._slots[id(request)] = slot
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._slots_lock:
            slot = self._slots.pop(id(request), None)
        if slot is not None:
            self.gate.release(slot)
        super().shutdown_request(request)


class BootstrapServer:
    """``GET /query`` and ``POST /register`` on ``host:port``, from a thread of its own."""

    def __init__(self, host: str, port: int, dp_rank: int, engine_id: str, endpoint: str,
                 auth: ChannelAuth | None = None, limits: ListenerLimits | None = None,
                 query_auth: bool = False):
        """``query_auth``: also require the signed header on ``GET /query``
        (``bootstrap_query_auth``)."""
        self._entries: dict[str, dict[str, Any]] = {str(dp_rank): engine_entry(engine_id,
                                                                               endpoint)}
        self._lock = threading.Lock()
        auth = auth or ChannelAuth()
        limits = limits or ListenerLimits()
        self.verifier = RequestVerifier(auth)
        self.query_auth = query_auth and auth.requires_secret
        handler = _handler_for(self, limits.handshake_timeout_s)
        try:
            self._http = _GatedHTTPServer((host, port), handler,
                                          Gate("bootstrap endpoint", host, auth, limits))
        except OSError as e:
            raise BootstrapError(
                f"cannot serve the LayerKV bootstrap endpoint on {host}:{port}: {e}; set "
                "kv_connector_extra_config.bootstrap_port to a free port (or 0 to turn the "
                "endpoint off when no router reads it)") from None
        self.port = self._http.server_address[1]
        # close() waits for the serving loop to see the stop flag, which it checks once per
        # poll interval (socketserver's default 0.5 s): a shorter one keeps an engine's
        # shutdown from waiting on it
        start_thread(lambda: self._http.serve_forever(poll_interval=SHUTDOWN_POLL_S),
                     "layerkv-bootstrap")
        logger.info("LayerKV bootstrap endpoint http://%s:%d/query (engine %s)", host,
                    self.port, engine_id)

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {rank: dict(entry) for rank, entry in self._entries.items()}

    def add(self, dp_rank: int, engine_id: str, endpoint: str) -> None:
        with self._lock:
            self._entries[str(dp_rank)] = engine_entry(engine_id, endpoint)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _handler_for(server: BootstrapServer, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            self.timeout = timeout  # a request must arrive within handshake_timeout_s
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/query":
                self._answer(404, {"error": "the bootstrap endpoint serves GET /query"})
                return
            if server.query_auth and not self._signed("GET", b""):
                return
            self._answer(200, server.entries())

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/register":
                self._answer(404, {"error": "the bootstrap endpoint takes POST /register"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY_BYTES:
                    raise ValueError(f"body of {length} bytes (1-{MAX_BODY_BYTES} expected)")
                raw = self.rfile.read(length)
                if not self._signed("POST", raw):
                    return
                body = json.loads(raw)
                rank, engine_id, endpoint = (body["dp_rank"], body["engine_id"],
                                             body["layerkv_endpoint"])
                if not (isinstance(rank, int) and rank >= 0 and isinstance(engine_id, str)
                        and isinstance(endpoint, str) and endpoint):
                    raise ValueError("dp_rank (int >= 0), engine_id and layerkv_endpoint "
                                     "(strings) expected")
            except (ValueError, KeyError, TypeError) as e:
                self._answer(400, {"error": f"bad registration: {e}"})
                return
            server.add(rank, engine_id, endpoint)
            self._answer(200, {"ok": True})

        def _signed(self, method: str, body: bytes) -> bool:
            """Whether the request carries a valid signature (without a secret: always);
            answers 401 when not."""
            try:
                server.verifier.verify(method, self.path, body,
                                       self.headers.get("Authorization"))
            except AuthError as e:
                logger.warning("LayerKV bootstrap endpoint refused %s %s from %s: %s", method,
                               self.path[:64], self.client_address[0], e)
                self._answer(401, {"error": str(e)})
                return False
            return True

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # routers poll it; vLLM's own access log is enough

    return Handler


def register_with(host: str, port: int, dp_rank: int, engine_id: str, endpoint: str,
                  auth: ChannelAuth | None = None) -> None:
    """From a data-parallel rank other than 0: add this engine's entry to rank 0's endpoint,
    retrying in the background while rank 0 starts (each attempt signed afresh)."""
    auth = auth or ChannelAuth()
    body = json.dumps({"dp_rank": dp_rank, "engine_id": engine_id,
                       "layerkv_endpoint": endpoint}).encode()
    url = f"http://{host}:{port}/register"

    def run() -> None:
        backoff = Backoff(0.1, 5.0)
        waited = 0.0
        while True:
            try:
                headers = {"Content-Type": "application/json",
                           **sign_request(auth, "POST", "/register", body)}
                req = urllib.request.Request(url, data=body, method="POST", headers=headers)
                with urllib.request.urlopen(req, timeout=5):
                    logger.info("LayerKV engine %s (data-parallel rank %d) registered with "
                                "the bootstrap endpoint %s", engine_id, dp_rank, url)
                    return
            except (OSError, urllib.error.URLError) as e:
                if waited >= REGISTER_RETRY_S:
                    logger.error("LayerKV: cannot register data-parallel rank %d with the "
                                 "bootstrap endpoint %s: %s; routers will not find this rank",
                                 dp_rank, url, e)
                    return
                wait = backoff.next()
                waited += wait
                time.sleep(wait)

    start_thread(run, "layerkv-bootstrap-register")


def resolve(bootstrap_addr: str, engine_id: str, timeout: float,
            auth: ChannelAuth | None = None) -> str:
    """P's LayerKV registration endpoint (``host:port``) for ``engine_id``, asked of the
    bootstrap endpoint at ``bootstrap_addr`` (``http://host:port``), signed."""
    url = bootstrap_addr.rstrip("/") + "/query"
    path = urllib.parse.urlsplit(url).path
    request = urllib.request.Request(url, headers=sign_request(auth or ChannelAuth(), "GET",
                                                               path))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as e:
        raise BootstrapError(f"the prefill bootstrap endpoint {url} answered HTTP {e.code}: "
                             f"{_error_text(e)}") from None
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise BootstrapError(f"cannot query the prefill bootstrap endpoint {url}: {e}") from None
    if not isinstance(answer, dict):
        raise BootstrapError(f"{url} answered {type(answer).__name__}, not a JSON object")
    engines = [e for e in answer.values() if isinstance(e, dict)]
    for entry in engines:
        if entry.get("engine_id") == engine_id:
            endpoint = entry.get("layerkv_endpoint")
            if not isinstance(endpoint, str) or not endpoint:
                raise BootstrapError(
                    f"prefill engine {engine_id} at {url} is not a LayerKV instance (its entry "
                    "has no layerkv_endpoint); run the prefill instance with kv_connector "
                    "LayerKV")
            return endpoint
    known = sorted(str(e.get("engine_id")) for e in engines)
    raise BootstrapError(f"{url} knows no prefill engine {engine_id!r} (it lists {known}); "
                         "the router's remote_engine_id is stale if P restarted: pin "
                         "kv_transfer_config.engine_id on P")


def _error_text(e: urllib.error.HTTPError) -> str:
    """The ``error`` of a bootstrap endpoint's JSON answer, else the HTTP reason."""
    try:
        body = json.loads(e.read(4096))
        return str(body["error"]) if isinstance(body, dict) and "error" in body else str(body)
    except (OSError, ValueError):
        return str(e.reason)

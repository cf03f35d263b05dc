"""The ``kv_transfer_params`` a client (a P/D router) puts on a request, parsed and validated.

LayerKV speaks three request contracts (docs/deployment.md):

LayerKV's own proxy, and concurrent Mooncake-style routers (llm-d's sidecar): P and D at once.
  Prefill:  {"do_remote_decode": true, "transfer_id": "<id>"}
  Decode:   {"do_remote_prefill": true, "transfer_id": "<id>", "remote_host": "<P host>",
             "remote_port": <P registration port>, "first_token_from_prefill": false}
         or {"do_remote_prefill": true, "transfer_id": "<id>",
             "remote_bootstrap_addr": "http://<P host>:<bootstrap port>",
             "remote_engine_id": "<P engine id, from the bootstrap endpoint's /query>"}
  (``first_token_from_prefill``: D continues from the token P samples after the prompt,
  which the proxy has already sent to the client; docs/proxy.md)
Sequential NIXL-style routers (vllm-router --kv-connector nixl, llm-d nixlv2, vLLM's toy
proxy): P first, with {"do_remote_decode": true} and no transfer_id; P mints one and answers
the decode request's params in its response, which the router copies into D's request.
Discovery (LayerKV's proxy at start-up): {"layerkv_discover": true} on a prefill instance; its
response carries {"layerkv_endpoint": "host:port"}.

Anything else that mentions these keys but is malformed raises ``ParamsError`` with a message
saying what to change; the connector then serves the request locally (or, on a decode instance
with ``remote_prefill_fallback: fail``, fails it) and returns the message as
``kv_transfer_params.layerkv_error`` in the response (a request is never dropped or crashed).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TRANSFER_ID_LEN = 256


class ParamsError(ValueError):
    pass


@dataclass(frozen=True)
class PrefillParams:
    transfer_id: str | None
    """None: the router sent none; the scheduler mints one."""
    sequential: bool = False
    """The sequential contract: D learns the transfer id from P's answer."""


@dataclass(frozen=True)
class BootstrapAddress:
    """Where D finds P through P's bootstrap endpoint (scheduler/bootstrap.py)."""

    bootstrap_addr: str
    engine_id: str

    def __str__(self) -> str:
        return f"{self.bootstrap_addr} (engine {self.engine_id})"


PrefillAddress = str | BootstrapAddress
"""P's registration endpoint ``host:port``, or how to find it."""


@dataclass(frozen=True)
class DecodeParams:
    transfer_id: str
    remote: PrefillAddress
    first_token_from_prefill: bool = False


@dataclass(frozen=True)
class DiscoverParams:
    pass


Parsed = PrefillParams | DecodeParams | DiscoverParams | None


def parse(params: object) -> Parsed:
    """The LayerKV role a request asks for, or None for a plain local request. ``params`` is
    the request's ``kv_transfer_params`` as the client sent it: anything, checked here."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    if params.get("layerkv_discover"):
        return DiscoverParams()
    remote_decode = bool(params.get("do_remote_decode"))
    remote_prefill = bool(params.get("do_remote_prefill"))
    if not (remote_decode or remote_prefill):
        return None
    if remote_decode and remote_prefill:
        raise ParamsError("kv_transfer_params sets both do_remote_decode and do_remote_prefill; "
                          "set do_remote_decode on the prefill request only and "
                          "do_remote_prefill on the decode request only")
    tid = params.get("transfer_id")
    if remote_decode and tid is None:
        return PrefillParams(None, sequential=True)
    if not isinstance(tid, str) or not tid or len(tid) > MAX_TRANSFER_ID_LEN:
        raise ParamsError("kv_transfer_params.transfer_id must be a non-empty string of at most "
                          f"{MAX_TRANSFER_ID_LEN} characters (the same on the prefill and the "
                          "decode request), got " + repr(tid)[:80])
    if remote_decode:
        return PrefillParams(tid)
    first = params.get("first_token_from_prefill", False)
    if not isinstance(first, bool):
        raise ParamsError("kv_transfer_params.first_token_from_prefill must be true or false, "
                          f"got {first!r}")
    return DecodeParams(tid, _prefill_address(params), first)


def _prefill_address(params: dict[str, object]) -> PrefillAddress:
    """remote_host + remote_port, or remote_bootstrap_addr + remote_engine_id."""
    if "remote_bootstrap_addr" in params and params.get("remote_host") is None:
        addr, engine = params.get("remote_bootstrap_addr"), params.get("remote_engine_id")
        if not isinstance(addr, str) or not addr.startswith(("http://", "https://")):
            raise ParamsError("kv_transfer_params.remote_bootstrap_addr must be the prefill "
                              "instance's bootstrap URL (http://host:port), got "
                              + repr(addr)[:80])
        if not isinstance(engine, str) or not engine:
            raise ParamsError("kv_transfer_params.remote_engine_id must name the prefill engine "
                              "(its engine_id in the bootstrap endpoint's /query answer), got "
                              + repr(engine)[:80])
        return BootstrapAddress(addr.rstrip("/"), engine)
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise ParamsError("kv_transfer_params.remote_host must be the prefill instance's LayerKV "
                          f"host (a string), got {host!r}; or send remote_bootstrap_addr and "
                          "remote_engine_id")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ParamsError("kv_transfer_params.remote_port must be the prefill instance's LayerKV "
                          f"registration port (1-65535), got {port!r}")
    return f"{host}:{port}"

"""``vllm-router`` (PyPI ``vllm-router``, a Rust binary in a wheel) in front of LayerKV prefill
(P) and decode (D) instances: the P/D router people deploy, for the e2e tests and the
benchmarks. It is the test extra's ``vllm-router==0.1.17``; its command lies next to the
interpreter (``<venv>/bin/vllm-router``).

What the router does in its P/D mode (``--vllm-pd-disaggregation``):

* It waits for ``GET /health`` of every instance. With ``--kv-connector mooncake`` it then asks
  each P's bootstrap endpoint (``GET http://<P host>:<bootstrap port>/query``) once for its
  engine id; it gives up, and exits, after about 265 s without an answer.
* ``mooncake``: per request it sends P the client's body with ``max_tokens: 1``,
  ``stream: false`` and ``kv_transfer_params {do_remote_decode: true, transfer_id:
  "xfer-<uuid4>"}``, waits for P's whole answer, then sends D the client's body with
  ``kv_transfer_params {do_remote_prefill: true, transfer_id, remote_bootstrap_addr:
  "http://<P host>:<bootstrap port>", remote_engine_id}`` and streams D's answer back.
* ``nixl``: P gets ``do_remote_decode: true`` and null ``remote_*`` fields, no transfer id;
  the router copies P's answer's ``kv_transfer_params`` into D's request as they are.

In both modes D is asked only once P has answered: through this router P's prefill does not
overlap the transfer (LayerKV moves the prompt's KV after P's last layer, in one go). The
concurrent contract (P and D at once, as llm-d's routing sidecar and vLLM's Mooncake proxy
send them) is what lets LayerKV stream during the prefill.

The router also sends ``Authorization: Bearer $OPENAI_API_KEY`` (from its environment) to every
instance, and serves Prometheus metrics on a port of its own (``--prometheus-port``, 29000
unless given: two routers on that default would clash, so :class:`VllmRouter` takes a free
one).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_layerkv.testing.servers import LOCALHOST, HelperProcess, ServerError, free_port

KV_CONNECTORS = ("mooncake", "nixl")
VERSION = "0.1.17"
"""The vllm-router release the tests and benchmarks run (pyproject.toml's test extra)."""


def router_command() -> str:
    """The ``vllm-router`` command of this interpreter's environment, else the first on PATH
    (an install elsewhere, e.g. ``pip install --target`` on a GPU host, with its ``bin`` on
    PATH). Raises if neither has one (``bash scripts/setup.sh`` installs it)."""
    path = Path(sys.executable).parent / "vllm-router"
    if os.access(path, os.X_OK):
        return str(path)
    if found := shutil.which("vllm-router"):
        return found
    raise ServerError(f"vllm-router is neither at {path} nor on PATH: install the test extra "
                      f"(pip install vllm-router=={VERSION}, or bash scripts/setup.sh)")


def router_args(prefills: Sequence[tuple[str, int | None]], decodes: Sequence[str], *,
                kv_connector: str, port: int | None, prometheus_port: int,
                policy: str = "round_robin", extra_args: Sequence[str] = ()) -> list[str]:
    """vllm-router's arguments (without the command) for P/D mode. ``prefills``: each P's
    base URL and bootstrap port (``mooncake`` mode needs it; ``nixl`` mode leaves it out);
    ``decodes``: each D's base URL; ``port``: the router's (None: the caller appends
    ``--port``). ``policy`` round_robin: the default, cache_aware, first asks each
    instance's ``/tokenize``."""
    if kv_connector not in KV_CONNECTORS:
        raise ValueError(f"kv_connector {kv_connector!r}: use one of {KV_CONNECTORS}")
    if not prefills or not decodes:
        raise ValueError("vllm-router needs at least one prefill and one decode instance")
    args = ["--vllm-pd-disaggregation", "--kv-connector", kv_connector]
    for url, bootstrap_port in prefills:
        if kv_connector != "mooncake":
            args += ["--prefill", url]
        elif bootstrap_port:
            args += ["--prefill", url, str(bootstrap_port)]
        else:
            raise ValueError(f"prefill {url}: mooncake mode needs its bootstrap port")
    for url in decodes:
        args += ["--decode", url]
    if port is not None:
        args += ["--port", str(port)]
    return [*args, "--policy", policy, "--host", LOCALHOST, "--prometheus-host", LOCALHOST,
            "--prometheus-port", str(prometheus_port),
            # instances are healthy before the router starts: check at once, not every 30 s
            "--worker-startup-check-interval", "1", *extra_args]


class VllmRouter(HelperProcess):
    """One ``vllm-router`` process in P/D mode on a free port of 127.0.0.1, logging to
    ``log_path``. Started on construction; :meth:`wait_ready` waits until it serves,
    :meth:`stop` stops it (its whole process group)."""

    def __init__(self, prefills: Sequence[tuple[str, int | None]], decodes: Sequence[str],
                 log_path: Path | str, *, kv_connector: str = "mooncake",
                 policy: str = "round_robin", extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.kv_connector = kv_connector
        self.port = free_port()
        self.log_path = Path(log_path)
        cmd = [router_command(), *router_args(
            prefills, decodes, kv_connector=kv_connector, port=self.port,
            prometheus_port=free_port(), policy=policy, extra_args=extra_args)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(("# " + " ".join(cmd) + "\n").encode())
        super().__init__(cmd, self.log_path, f"http://{LOCALHOST}:{self.port}",
                         env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until ``/health`` answers 200. The router binds its port only once every instance
        answered ``/health`` and, in mooncake mode, every P's bootstrap endpoint its
        ``/query``, so that answer means it routes. Raises with the log's tail otherwise."""
        try:
            super().wait_ready(timeout)
        except ServerError as e:
            raise ServerError(f"vllm-router: {e}; last log lines ({self.log_path}):\n"
                              f"{self.log_tail()}") from None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def start_router(prefills: Sequence[tuple[str, int | None]], decodes: Sequence[str],
                 log_path: Path | str, timeout: float = 120.0, **kw: object) -> VllmRouter:
    """A :class:`VllmRouter`, ready; stopped again if it does not become ready."""
    router = VllmRouter(prefills, decodes, log_path, **kw)  # type: ignore[arg-type]
    try:
        router.wait_ready(timeout)
    except BaseException:
        router.stop()
        raise
    return router

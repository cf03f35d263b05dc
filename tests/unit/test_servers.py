"""vllm_layerkv/testing/servers.py: the streamed-completion client the demo and the benchmark
time TTFT with, against a local server that streams like vLLM; and what a stopped server
leaves behind."""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vllm_layerkv.testing import servers
from vllm_layerkv.testing.servers import stream_completion

FIRST_TOKEN_DELAY_S = 0.2


class Streamer(BaseHTTPRequestHandler):
    """Answers /v1/completions with a role-only chunk, then two text chunks (the first after
    FIRST_TOKEN_DELAY_S) and [DONE]; remembers the request body."""

    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        Streamer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": []}\n\n')
        self.wfile.flush()
        time.sleep(FIRST_TOKEN_DELAY_S)
        for text in ("Hel", "lo"):
            chunk = {"choices": [{"index": 0, "text": text}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Streamer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_stream_completion_times_the_first_token_not_the_first_chunk(server: str) -> None:
    ttft, total, text = stream_completion(server, "m", [1, 2, 3], 2, ignore_eos=True)
    assert text == "Hello"
    assert FIRST_TOKEN_DELAY_S <= ttft <= total < FIRST_TOKEN_DELAY_S + 5
    assert Streamer.bodies[-1] == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2,
                                   "temperature": 0, "stream": True, "ignore_eos": True}


# A stand-in for `vllm serve` that leaves what vLLM leaves: a Unix socket in
# VLLM_RPC_BASE_PATH (its ZMQ ipc:// endpoints) and a mapped /dev/shm segment (its message
# queues); it reports both and cleans up neither.
FAKE_SERVE = """
import mmap, os, socket, sys, time
path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core")
sock = socket.socket(socket.AF_UNIX)
sock.bind(path)
shm = f"/dev/shm/layerkv-test-{os.getpid()}"
with open(shm, "wb+") as f:
    f.truncate(4096)
    mapped = mmap.mmap(f.fileno(), 4096)
print("left", path, shm, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stopped_server_leaves_no_socket_or_shared_memory_file(tmp_path, monkeypatch,
                                                                   how: str) -> None:
    monkeypatch.setattr(servers, "serve_command_prefix",
                        lambda: [sys.executable, "-c", FAKE_SERVE, "serve"])
    server = servers.VllmServer("model", servers.free_port(), served_model_name="m",
                                cpu_bind="0", log_path=tmp_path / "server.log")
    server.start()
    deadline = time.monotonic() + 30
    reported: list[str] = []
    while not reported and time.monotonic() < deadline:
        time.sleep(0.05)
        reported = [line for line in server.log_path.read_text().splitlines()
                    if line.startswith("left ")]
    assert reported, server.log_tail(20)
    sock, shm = (Path(p) for p in reported[0].split()[1:])
    assert sock.is_socket() and sock.parent != Path(tempfile.gettempdir()) and shm.exists()
    if how == "kill":  # a crash, as the failure tests cause; stop() then only reaps
        server.kill()
    server.stop(grace=5)
    assert not sock.exists() and not sock.parent.exists()
    assert not shm.exists()


# A stand-in for `vllm serve` that uses torch inductor's default cache as a compiling server
# does: in <its temporary folder>/<argv[1]>; it says what it found there, adds its own entry,
# then waits to be stopped.
FAKE_COMPILING_SERVE = """
import os, sys, tempfile, time
cache = os.path.join(tempfile.gettempdir(), sys.argv[1])
os.makedirs(cache, exist_ok=True)
print("found", sorted(os.listdir(cache)), flush=True)
open(os.path.join(cache, f"kernel-{os.getpid()}.so"), "w").close()
print("compiled", flush=True)
time.sleep(600)
"""


def test_servers_on_cpu_share_torch_inductors_default_cache(tmp_path, monkeypatch) -> None:
    """A CPU server's temporary folder is its own, but torch inductor's default cache in it is
    the user's shared one: the next server finds what the last one compiled, and stopping a
    server removes its folder, not the cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = Path(default_cache_dir())  # torch's own answer, in the (patched) temporary folder
    assert shared.parent == tmp_path
    monkeypatch.setattr(servers, "serve_command_prefix",
                        lambda: [sys.executable, "-c", FAKE_COMPILING_SERVE, shared.name])
    found: list[str] = []
    for n in range(2):
        server = servers.VllmServer("model", servers.free_port(), served_model_name="m",
                                    cpu_bind="0", log_path=tmp_path / f"server{n}.log")
        server.start()
        own_folder = Path(server._tmp_dir or "")  # noqa: SLF001 - the folder under test
        deadline = time.monotonic() + 30
        # whole lines only: the log starts with the command, which holds this script's text
        lines: list[str] = []
        while "compiled" not in lines and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = server.log_path.read_text().splitlines()
        found += [line for line in lines if line.startswith("found [")]
        server.stop(grace=5)
        assert own_folder != tmp_path and not own_folder.exists()
    assert found[0] == "found []" and found[1].startswith("found ['kernel-"), found
    assert len(list(shared.glob("kernel-*.so"))) == 2


def test_free_port_never_hands_out_a_port_twice() -> None:
    """The kernel can return one port to bind-to-0 twice while nothing listens on it, and two
    vLLM servers (SO_REUSEPORT) would then share it."""
    from vllm_layerkv.testing.servers import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_free_port_stays_below_the_kernels_ephemeral_range() -> None:
    """A port from bind-to-0 can go to the next listener that binds port 0 (another server's
    own listener) before the server it was picked for binds it."""
    from vllm_layerkv.testing.servers import ephemeral_port_range, free_port

    lo, hi = ephemeral_port_range()
    assert 0 < lo <= hi
    ports = [free_port() for _ in range(50)]
    if lo - 10000 >= 1000:
        assert all(10000 <= p < lo for p in ports), (lo, ports)
    for p in ports:  # each one can be listened on
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()

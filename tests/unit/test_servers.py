"""vllm_layerkv/testing/servers.py: the streamed-completion client the demo and the benchmark
time TTFT with, against a local server that streams like vLLM."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

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

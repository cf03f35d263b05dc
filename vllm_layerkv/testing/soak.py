"""Soak: many requests through the P/D proxy at a fixed concurrency, some aborted by the client,
every completed one checked against a single-instance reference (greedy, float32).

What a run proves, request by request:

* **no wrong output**: a request that completes streams exactly the reference's text;
* **no hung request**: every request ends (completed, aborted by us, or an error) within
  ``request_timeout_s``;
* **no error**: apart from the requests we abort, every request answers 200 and completes.

Leaks are checked by the caller after the run (``cluster.wait_idle`` on P and D: no running or
waiting requests, 0 % KV usage), because only the caller knows when the servers should be idle.

Aborts are real client disconnects at a random point: while the prefill runs (the socket is
closed before the proxy has answered) or while D streams (closed after the first tokens).

The long run (docs/reliability.md) starts its own cluster::

    python -m vllm_layerkv.testing.soak --requests 1000 --concurrency 16 --abort-fraction 0.1
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vllm_layerkv.testing.prompts import make_prompt

MODEL_NAME = "m"
PROMPT_WORDS = (6, 20, 45, 90, 160, 240, 330, 450, 600, 800, 1000)
"""Prompt lengths (words; ~1.3 tokens each): short ones sent whole, long ones streamed in several
chunks through a prefill instance with a small batch budget."""


@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 16
    abort_fraction: float = 0.1
    max_tokens: int = 16
    distinct_prompts: int = 44
    seed: int = 0
    request_timeout_s: float = 300.0


@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    """Requests this run disconnected on purpose: the two below."""
    aborted_before_answer: int = 0
    """... before the proxy answered (P and D both busy with the request)."""
    aborted_while_streaming: int = 0
    """... after D's first tokens (D decoding)."""
    wrong: list[dict[str, Any]] = field(default_factory=list)
    hung: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    completed_latency_p50_s: float = 0.0
    completed_latency_max_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.hung or self.errors) and \
            self.completed + self.aborted == self.sent

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def soak_prompts(count: int, seed: int) -> list[str]:
    """``count`` distinct prompts cycling through ``PROMPT_WORDS``."""
    return [make_prompt(PROMPT_WORDS[i % len(PROMPT_WORDS)], seed=10_000 + seed * 1000 + i)
            for i in range(count)]


def reference_texts(reference_url: str, prompts: list[str], max_tokens: int,
                    concurrency: int = 4) -> list[str]:
    """Greedy completions of ``prompts`` on the single (reference) instance."""
    def one(prompt: str) -> str:
        status, data = _post(reference_url, _body(prompt, max_tokens, stream=False), 600)
        if status != 200:
            raise RuntimeError(f"reference instance answered {status}: {data[:500]}")
        return json.loads(data)["choices"][0]["text"]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def run_soak(proxy_url: str, prompts: list[str], references: list[str],
             config: SoakConfig) -> SoakResult:
    """Send ``config.requests`` streamed completions through the proxy, ``config.concurrency``
    at a time; ``abort_fraction`` of them are disconnected at a random point."""
    rng = random.Random(config.seed)
    plan = []
    for i in range(config.requests):
        abort = None
        if rng.random() < config.abort_fraction:
            abort = ("prefill", rng.uniform(0.02, 0.6)) if rng.random() < 0.5 else ("decode", 0)
        plan.append((i, rng.randrange(len(prompts)), abort))
    result = SoakResult(sent=config.requests)
    lock = threading.Lock()
    latencies: list[float] = []

    def one(item: tuple[int, int, tuple[str, float] | None]) -> None:
        i, p, abort = item
        t0 = time.monotonic()
        try:
            outcome, detail = _one_request(proxy_url, prompts[p], references[p], abort, config)
        except Exception as e:  # noqa: BLE001 - one request's failure is a result, not a crash
            outcome, detail = "errors", f"{type(e).__name__}: {e}"
        record = {"request": i, "prompt": p, "abort": abort, "detail": detail,
                  "seconds": round(time.monotonic() - t0, 3)}
        with lock:
            if outcome == "completed":
                result.completed += 1
                latencies.append(time.monotonic() - t0)
            elif outcome == "aborted":
                result.aborted += 1
                if abort is not None and abort[0] == "prefill":
                    result.aborted_before_answer += 1
                else:
                    result.aborted_while_streaming += 1
            else:
                getattr(result, outcome).append(record)

    t_start = time.monotonic()
    with ThreadPoolExecutor(config.concurrency) as pool:
        list(pool.map(one, plan))
    result.seconds = round(time.monotonic() - t_start, 1)
    if latencies:
        latencies.sort()
        result.completed_latency_p50_s = round(latencies[len(latencies) // 2], 3)
        result.completed_latency_max_s = round(latencies[-1], 3)
    return result


# ------------------------------------------------------------------------------- one request


def _body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream}).encode()


def _post(url: str, body: bytes, timeout: float) -> tuple[int, str]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def _one_request(proxy_url: str, prompt: str, reference: str,
                 abort: tuple[str, float] | None, config: SoakConfig) -> tuple[str, str]:
    """Returns (outcome, detail); outcome is completed, aborted, wrong, hung or errors (the
    last three name SoakResult's lists)."""
    u = urlsplit(proxy_url)
    body = _body(prompt, config.max_tokens, stream=True)
    if abort is not None and abort[0] == "prefill":
        # Disconnect before the proxy has answered: P and D are both mid-request.
        sock = socket.create_connection((u.hostname, u.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        time.sleep(abort[1])
        sock.close()
        return "aborted", f"disconnected after {abort[1]:.2f} s"
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=config.request_timeout_s)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return "errors", f"HTTP {resp.status}: {resp.read()[:500]!r}"
        text: list[str] = []
        done = False
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return "errors", f"error event: {json.dumps(event)[:500]}"
            text.append(event["choices"][0].get("text") or "")
            if abort is not None:  # decode-phase abort: we have D's first tokens
                return "aborted", f"disconnected after {len(text)} chunk(s)"
        got = "".join(text)
        if not done:
            return "errors", f"stream ended without [DONE] after {got!r}"
        if got != reference:
            return "wrong", f"got {got!r}, reference {reference!r}"
        return "completed", ""
    except (TimeoutError, socket.timeout):
        return "hung", f"no answer within request_timeout_s={config.request_timeout_s:.0f}"
    finally:
        conn.close()  # for a decode-phase abort this is the client disconnect


# ------------------------------------------------------------------------------- long run


def main(argv: list[str] | None = None) -> int:
    from vllm_layerkv.testing.cluster import ClusterSpec, PDCluster, wait_idle
    from vllm_layerkv.testing.models import model_path

    ap = argparse.ArgumentParser(description="LayerKV P/D soak on CPU (SmolLM2, float32): "
                                 "starts reference + P + D + proxy, runs, checks leaks.")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/layerkv-soak"))
    ap.add_argument("--json", type=Path, help="write the result here too")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--requests, --concurrency and --max-tokens must be at least 1")
    if not 0.0 <= args.abort_fraction <= 1.0:
        ap.error(f"--abort-fraction {args.abort_fraction} must be between 0 and 1")
    config = SoakConfig(requests=args.requests, concurrency=args.concurrency,
                        abort_fraction=args.abort_fraction, max_tokens=args.max_tokens,
                        seed=args.seed)
    spec = ClusterSpec(model=model_path("smollm2"), workdir=args.workdir)
    with PDCluster(spec) as cluster:
        assert cluster.reference is not None and cluster.proxy is not None
        prompts = soak_prompts(config.distinct_prompts, config.seed)
        refs = reference_texts(cluster.reference.url, prompts, config.max_tokens)
        result = run_soak(cluster.proxy.url, prompts, refs, config)
        leaks = {s.log_path.stem: wait_idle(s, timeout=60) for s in
                 (cluster.prefill, cluster.decode)}
        healthy = all(s.poll_ready() for s in (cluster.prefill, cluster.decode))
    report = {**result.summary(), "leaks": leaks, "servers_healthy_after": healthy,
              "config": asdict(config)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    clean = result.ok and healthy and not any(v for r in leaks.values() for v in r.values())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

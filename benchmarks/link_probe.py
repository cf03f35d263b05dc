"""Link probe: how fast each LayerKV transport moves KV from P's KV memory into D's, alone.

Two processes, P on one device and D on another (on GPU each sees only its own GPU through
CUDA_VISIBLE_DEVICES, as ``vllm serve`` instances do; on CPU both use host memory), run
LayerKV's own sender, receiver bookkeeping and transport classes: the path a transfer takes in
a serving instance, with the same pinned staging buffers, sockets or engine, and nothing else
running. The transport's settings come from the environment as in an instance
(``LAYERKV_*`` variables; NIXL's UCX from ``UCX_TLS``, with ``host_bounce`` resolved as LayerKV
resolves it). Each transfer is one prompt's KV, sent in layer groups as the prefill hooks queue
them; the first opens the connection and is not timed, the next ``--repeats`` are, one after
the other, each from the moment its groups are queued to D's acknowledgement. The rate
reported is the median of those, in GB/s (1e9 bytes per second). D checks sampled blocks of
every transfer against P's pattern, so a probe that moved the wrong bytes fails.

ttft_bench.py reads the output (``--link-probe``) for its ideal TTFT; this file also holds the
KV size arithmetic it uses (``kv_token_bytes``).

GPU:  python3 benchmarks/link_probe.py --device cuda --model $MODEL --out probe.json
      UCX_TLS=tcp,cuda_copy,self python3 benchmarks/link_probe.py --device cuda \
          --model $MODEL --transports nixl --out probe_ucx_tcp.json
CPU:  python benchmarks/link_probe.py --device cpu --model .models/tiny-llama --tokens 512 \
          --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 16
LLAMA_8B = {"num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32,
            "hidden_size": 4096, "head_dim": 128}
"""Llama-3.1-8B's KV shape, when no ``--model`` is given."""
HYBRID_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_type_list")
"""config.json keys of models whose layers are not all attention (Mamba hybrids)."""
PATTERN_MOD = 251
START_TIMEOUT_S = 120.0
"""How long a decode side may take to import, build its KV and listen."""


# ----------------------------------------------------------------------- KV size arithmetic


def dtype_bytes(dtype: str, kv_cache_dtype: str | None = None) -> int:
    """Bytes of one KV element: 1 for an fp8 KV cache, else the model's dtype's."""
    if kv_cache_dtype and kv_cache_dtype.startswith("fp8"):
        return 1
    sizes = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
    if dtype not in sizes:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(sizes)}")
    return sizes[dtype]


def kv_geometry(model_config: dict[str, Any]) -> tuple[int, int]:
    """(layers, KV elements per token and layer) of a model's config.json: 2 x KV heads x head
    size for attention, kv_lora_rank + qk_rope_head_dim for MLA (one latent per token). Raises
    ValueError for hybrid models, whose Mamba state is per request, not per token."""
    hybrid = [k for k in HYBRID_KEYS if model_config.get(k)]
    if hybrid:
        raise ValueError(f"a hybrid model ({hybrid[0]} in config.json): its KV is not a "
                         f"per-token size")
    layers = int(model_config["num_hidden_layers"])
    if model_config.get("kv_lora_rank"):
        return layers, int(model_config["kv_lora_rank"]) + int(
            model_config.get("qk_rope_head_dim") or 0)
    heads = int(model_config.get("num_attention_heads") or 0)
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_size = int(model_config.get("head_dim") or model_config["hidden_size"] // heads)
    return layers, 2 * kv_heads * head_size


def kv_token_bytes(model_config: dict[str, Any], dtype: str,
                   kv_cache_dtype: str | None = None) -> int:
    """KV bytes one prompt token adds over all layers (all TP ranks together)."""
    layers, elements = kv_geometry(model_config)
    return layers * elements * dtype_bytes(dtype, kv_cache_dtype)


def read_model_config(model: str | None) -> dict[str, Any]:
    if model is None:
        return dict(LLAMA_8B)
    path = Path(model) / "config.json"
    if not path.exists():
        raise SystemExit(f"--model {model}: no config.json there (give a model directory)")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------- reading results


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Every case of one or more probe output files."""
    cases: list[dict[str, Any]] = []
    for path in paths:
        cases += json.loads(Path(path).read_text())["results"]
    return cases


def probe_gbps(cases: list[dict[str, Any]], transport: str, ucx_tls: str | None
               ) -> float | None:
    """The measured rate (GB/s) of ``transport`` under this ``UCX_TLS`` (None: unset; only
    NIXL depends on it), or None if no successful case matches."""
    for case in cases:
        if not case.get("ok") or case["transport"] != transport:
            continue
        if transport == "nixl" and (case.get("ucx_tls") or None) != (ucx_tls or None):
            continue
        return float(case["gbps"])
    return None


# ----------------------------------------------------------------------- the two peers


def compat(spec: dict[str, Any]) -> Any:
    from vllm_layerkv.wire.protocol import CompatInfo

    return CompatInfo(vllm_version="link-probe", model="link-probe", dtype="uint8",
                      kv_layout="HND", block_size=BLOCK_TOKENS, num_kv_heads=1,
                      head_size=spec["block_bytes"], num_layers=spec["layers"],
                      block_bytes=spec["block_bytes"])


def pattern(layer: int, first_block: int, num_blocks: int, block_bytes: int,
            device: Any) -> Any:
    """P's bytes of ``num_blocks`` blocks of one layer from ``first_block`` (uint8)."""
    import torch

    index = torch.arange(num_blocks * block_bytes, device=device, dtype=torch.int64)
    index += first_block * block_bytes + layer * 131
    return (index % PATTERN_MOD).to(torch.uint8).view(num_blocks, block_bytes)


def make_layout(spec: dict[str, Any], num_blocks: int, filled: bool) -> Any:
    """A worker's KV: per layer a [num_blocks, block_bytes] uint8 tensor on the probe's
    device, P's filled with the pattern, D's zeroed."""
    import torch

    from vllm_layerkv.kv.layout import KVLayout

    device = "cuda" if spec["device"] == "cuda" else "cpu"
    caches = {}
    for layer in range(spec["layers"]):
        caches[f"model.layers.{layer}.self_attn.attn"] = (
            pattern(layer, 0, num_blocks, spec["block_bytes"], device) if filled else
            torch.zeros(num_blocks, spec["block_bytes"], dtype=torch.uint8, device=device))
    return KVLayout.from_kv_caches(caches, num_blocks)


def transport_config(spec: dict[str, Any]) -> Any:
    """The transport's settings as an instance reads them: the environment's ``LAYERKV_*``
    variables under the probed ``transport``. A worker's process-wide one, the GIL switch
    interval, is set here as a worker sets it."""
    from vllm_layerkv.common.threads import set_switch_interval
    from vllm_layerkv.config import LayerKVConfig

    config = LayerKVConfig.from_extra_config({"transport": spec["transport"]})
    set_switch_interval(config.gil_switch_interval_ms)
    return config


def run_d(spec: dict[str, Any]) -> dict[str, Any]:
    """D: listen, expect every transfer (each into blocks of its own), wait for them, check."""
    from vllm_layerkv.counters import WorkerStats
    from vllm_layerkv.kv.blockio import block_io_for
    from vllm_layerkv.tasks import RecvTask
    from vllm_layerkv.transport import create_transport
    from vllm_layerkv.worker.receiver import RecvTable

    n, count = spec["blocks"], spec["transfers"]
    layout = make_layout(spec, n * count, filled=False)
    blocks = block_io_for(layout)
    table = RecvTable(compat(spec), tp_rank=0, tp_size=1, unknown_wait_s=30.0,
                      stats=WorkerStats())
    config = transport_config(spec)
    transport = create_transport(spec["transport"], blocks, config)
    endpoint = transport.start_receiver("127.0.0.1", 0, table, blocks, config.io_timeout_s)
    for i in range(count):
        table.expect(RecvTask(f"req-{i}", f"probe-{i}", list(range(i * n, (i + 1) * n))))
    print(json.dumps({"endpoint": endpoint}), flush=True)
    start_busy_threads(spec["busy_threads"])
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + spec["timeout"]
    while len(finished | failed) < count and time.monotonic() < deadline:
        table.results_ready.wait(0.1)
        done, bad = table.drain()
        finished |= done
        failed |= bad
    mismatched = 0
    for i in range(count):  # the first, a middle and the last block of each, every layer
        for b in sorted({0, n // 2, n - 1}):
            for layer in range(spec["layers"]):
                got = layout.tensors[layer][i * n + b].to("cpu")
                want = pattern(layer, b, 1, spec["block_bytes"], "cpu")[0]
                mismatched += int(not bool((got == want).all()))
    transport.shutdown()
    return {"finished": len(finished), "failed": sorted(failed), "mismatched": mismatched}


def run_p(spec: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """P: send the transfers one after the other, as the layer hooks queue a prompt's groups;
    time each from its first group queued to D's acknowledgement."""
    import torch

    from vllm_layerkv.common.trace import Tracer
    from vllm_layerkv.counters import WorkerStats
    from vllm_layerkv.kv.blockio import block_io_for
    from vllm_layerkv.tasks import Peer, SendTask
    from vllm_layerkv.transport import create_transport
    from vllm_layerkv.wire.protocol import Hello
    from vllm_layerkv.worker.sender import (
        FinishTransfer,
        GroupSend,
        Sender,
        SenderParts,
        SenderTuning,
    )

    n, layers = spec["blocks"], spec["layers"]
    layout = make_layout(spec, n, filled=True)
    blocks = block_io_for(layout)
    config = transport_config(spec)
    transport = create_transport(spec["transport"], blocks, config)
    hello = Hello(compat=compat(spec), engine_id="probe-p", tp_rank=0, tp_size=1)
    sender = Sender(SenderParts(transport, blocks, hello, stats=WorkerStats(),
                                tracer=Tracer("", "p", 0)), SenderTuning.from_config(config))
    peer = Peer(engine_id="probe-d", tp_size=1, data_endpoints=[endpoint])
    groups = [list(range(i, min(i + spec["group"], layers)))
              for i in range(0, layers, spec["group"])]
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
    seconds, states = [], []
    start_busy_threads(spec["busy_threads"])
    try:
        for i in range(spec["transfers"]):
            t = SendTask(req_id=f"req-{i}", transfer_id=f"probe-{i}", peer=peer,
                         src_blocks=[list(range(n))], dst_blocks=[list(range(i * n, (i + 1) * n))],
                         final=True, new_tokens=BLOCK_TOKENS * n)
            sender.outgoing(t)
            t0 = time.monotonic()
            for g, group in enumerate(groups):
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record()
                sender.put(GroupSend(step=1, group=g, layers=group, tasks=[t], event=event,
                                     layers_through=group[-1] + 1, num_layers=layers))
            sender.put(FinishTransfer(t, t_compute_end=time.monotonic()))
            state = wait_terminal(sender, t.transfer_id, spec["timeout"])
            seconds.append(time.monotonic() - t0)
            states.append(state)
            if not state.startswith("acked"):
                break
        channel = next(iter(sender._channels.values()), None)
        return {"seconds": seconds, "states": states, "used": transport.name,
                "direct": bool(getattr(channel, "direct", False)),
                "bounces": bool(getattr(channel, "bounces", False)),
                "streams": getattr(channel, "streams", 1)}
    finally:
        sender.shutdown()
        transport.shutdown()


def wait_terminal(sender: Any, transfer_id: str, timeout: float) -> str:
    """The transfer's final state (``acked`` or ``failed <reason>``), or ``timed out``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sender.state.lock:
            out = sender.state.transfers[transfer_id]
            if out.terminal:
                return f"{out.state} {out.reason}".strip()
        sender.state.changed.wait(0.01)
        sender.state.changed.clear()
    return "timed out"


def start_busy_threads(count: int) -> None:
    """``--busy-threads``: threads that run Python without pause, started once the peer is set
    up (before, they would slow its imports a hundredfold): a stand-in for a vLLM engine
    thread that holds the GIL while it steps, to measure how much of the path needs the GIL."""
    def spin() -> None:
        n = 0
        while True:
            n += 1

    for i in range(count):
        threading.Thread(target=spin, name=f"probe-busy-{i}", daemon=True).start()


def peer_main(role: str, spec: dict[str, Any], endpoint: str | None) -> int:
    result = run_d(spec) if role == "d" else run_p(spec, endpoint or "")
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    # NIXL 1.5.1 crashes the interpreter's teardown once an agent existed
    os._exit(0)


# ----------------------------------------------------------------------- the probe


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def run_case(transport: str, args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """One transport: D, then P, each in a process of its own; the case's record."""
    spec = {**spec, "transport": transport}
    case: dict[str, Any] = {
        "transport": transport, "ucx_tls": os.environ.get("UCX_TLS"), "device": args.device,
        "p_gpu": args.p_gpu if args.device == "cuda" else None,
        "d_gpu": args.d_gpu if args.device == "cuda" else None,
        "tokens": spec["blocks"] * BLOCK_TOKENS, "layers": spec["layers"],
        "nbytes": spec["blocks"] * spec["layers"] * spec["block_bytes"], "ok": False}
    if transport == "cuda_ipc" and args.device != "cuda":
        return {**case, "error": "cuda_ipc moves GPU memory: probe it with --device cuda"}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    here = str(Path(__file__).resolve())

    def peer_env(gpu: str) -> dict[str, str]:
        return dict(env, CUDA_VISIBLE_DEVICES=gpu) if args.device == "cuda" else env

    log = args.out.with_suffix(f".{transport}.log")
    with open(log, "w") as d_err:
        d = subprocess.Popen([sys.executable, here, "--peer", "d", json.dumps(spec)],
                             stdout=subprocess.PIPE, stderr=d_err, text=True,
                             env=peer_env(args.d_gpu), start_new_session=True)
        # a decode side that never listens is killed, which ends the wait for its endpoint
        watchdog = threading.Timer(START_TIMEOUT_S, d.kill)
        watchdog.start()
        try:
            endpoint = None
            assert d.stdout is not None
            for line in d.stdout:  # engines may print to stdout before the endpoint
                if line.startswith('{"endpoint"'):
                    endpoint = json.loads(line)["endpoint"]
                    break
            watchdog.cancel()
            if endpoint is None:
                d.wait(30)
                return {**case, "error": f"decode side exited with {d.returncode} before it "
                                         f"listened: {tail(log)}"}
            p = subprocess.run([sys.executable, here, "--peer", "p", json.dumps(spec), endpoint],
                               capture_output=True, text=True, env=peer_env(args.p_gpu),
                               timeout=spec["timeout"] + 60)
            d_out, _ = d.communicate(timeout=spec["timeout"] + 60)
        except subprocess.TimeoutExpired:
            return {**case, "error": f"did not finish in {spec['timeout'] + 60:.0f} s"}
        finally:
            watchdog.cancel()
            if d.poll() is None:
                d.kill()
                d.wait()
    p_res, d_res = last_json(p.stdout), last_json(d_out)
    if p_res is None or d_res is None:
        return {**case, "error": f"prefill side exited with {p.returncode}: "
                                 f"{p.stderr[-2000:]}{tail(log)}"}
    case.update(used=p_res["used"], direct=p_res["direct"], bounces=p_res["bounces"],
                streams=p_res.get("streams", 1),
                states=p_res["states"], seconds=[round(s, 6) for s in p_res["seconds"]],
                checked=d_res)
    timed = p_res["seconds"][1:]
    acked = all(s.startswith("acked") for s in p_res["states"])
    if not acked or len(timed) != args.repeats:
        return {**case, "error": f"transfers did not all complete: {p_res['states']}"}
    if d_res["mismatched"] or d_res["failed"]:
        return {**case, "error": f"decode side received wrong bytes: {d_res}"}
    gbps = [case["nbytes"] / s / 1e9 for s in timed]
    return {**case, "ok": True, "gbps": round(statistics.median(gbps), 4),
            "gbps_runs": [round(g, 4) for g in gbps]}


def tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return f"\n--- end of {path} ---\n{text[-chars:]}" if text else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="where P's and D's KV live (default cuda)")
    ap.add_argument("--transports", nargs="+", default=None,
                    choices=["tcp", "nixl", "mooncake", "cuda_ipc", "auto"],
                    help="transports to probe, in this order (default: tcp nixl cuda_ipc on "
                         "cuda, tcp nixl on cpu); one that cannot run here is recorded with "
                         "the reason")
    ap.add_argument("--model", default=None,
                    help="model directory whose config.json gives the KV shape (default: "
                         "Llama-3.1-8B's: 32 layers, 8 KV heads of 128)")
    ap.add_argument("--dtype", default=None,
                    help="KV element type (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8: one byte per element")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens per transfer")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed transfers per transport, after one untimed")
    ap.add_argument("--group", type=int, default=4, help="layers per layer group")
    ap.add_argument("--busy-threads", type=int, default=0,
                    help="threads in each of P and D that run Python without pause during the "
                         "transfers, holding the GIL as an engine thread does (default 0)")
    ap.add_argument("--p-gpu", default="0", help="P's GPU (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--d-gpu", default="1", help="D's GPU (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one transport's transfers may take")
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = ap.parse_args()
    if args.tokens < BLOCK_TOKENS or args.repeats < 1 or args.group < 1 or args.busy_threads < 0:
        ap.error("--tokens must be >= 16, --repeats and --group >= 1, --busy-threads >= 0")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model_config = read_model_config(args.model)
    try:
        layers, elements = kv_geometry(model_config)
        elem = dtype_bytes(dtype, args.kv_cache_dtype)
    except ValueError as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    transports = args.transports or (["tcp", "nixl", "cuda_ipc"] if args.device == "cuda"
                                     else ["tcp", "nixl"])
    spec = {"device": args.device, "layers": layers,
            "block_bytes": BLOCK_TOKENS * elements * elem,
            "blocks": math.ceil(args.tokens / BLOCK_TOKENS), "transfers": args.repeats + 1,
            "group": args.group, "timeout": args.timeout, "busy_threads": args.busy_threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"command": " ".join(sys.argv), "spec": spec, "results": []}
    for transport in transports:
        case = run_case(transport, args, spec)
        record["results"].append(case)
        args.out.write_text(json.dumps(record, indent=1))
        rate = f"{case['gbps']:.2f} GB/s" if case["ok"] else f"failed: {case['error'][:300]}"
        bounce = " host_bounce" if case.get("bounces") else ""
        if case.get("streams", 1) > 1:
            bounce += f", {case['streams']} TCP streams"
        print(f"[probe] {transport} ({case.get('used', '-')}{bounce}, UCX_TLS="
              f"{case['ucx_tls'] or '-'}): {case['nbytes'] / 1e6:.1f} MB per transfer, {rate}",
              flush=True)
    return 0 if any(c["ok"] for c in record["results"]) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        # one side of a case, started by run_case: --peer d|p SPEC_JSON [ENDPOINT]
        sys.exit(peer_main(sys.argv[2], json.loads(sys.argv[3]),
                           sys.argv[4] if len(sys.argv) > 4 else None))
    sys.exit(main())

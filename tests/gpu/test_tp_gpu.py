"""Prefill TP != decode TP on GPUs, one process per rank (as vLLM runs them): gather into
staging buffers on P's GPU -> CUDA IPC, NIXL or Mooncake into D's receive ring (or bytes over
TCP) -> scatter into D's blocks, every byte of every D rank checked (tp_peer.py). Skipped
without CUDA (CI); on a GPU host it also runs as a script, where pytest is not installed. The
NIXL and Mooncake cases need those engines and are skipped without.

Ranks go round-robin over the visible GPUs, D starting on the last one, so with two GPUs P TP2
-> D TP1 puts P rank 1 and D on one GPU and P rank 0 on the other: both same-device and
cross-device CUDA IPC are exercised. Set LAYERKV_GPU_RESULTS=path.json to keep the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from gpu_skip import run_as_script, skip

try:
    import pytest
except ImportError:  # the GPU image has no pytest: run this file as a script (bottom)
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PEER = str(Path(__file__).with_name("tp_peer.py"))
RESULTS: list[dict] = []


def gpu_of(role: str, rank: int) -> str:
    n = max(1, torch.cuda.device_count())
    return str(rank % n if role == "p" else (n - 1 + rank) % n)


def run_ranks(transport: str, heads: int, p_tp: int, d_tp: int, blocks: int = 1024,
              n: int = 256, layers: int = 32, group: int = 4, **extra) -> tuple[list, list]:
    """``n`` scattered source blocks -> ``n`` other destination blocks, 32 layers in groups
    of 4 (Llama-3.1-8B's KV per head and block)."""
    src = list(range(0, 2 * n, 2))
    dst = list(range(blocks - 1, blocks - 1 - n, -1))
    spec = {"transport": transport, "heads": heads, "p_tp": p_tp, "d_tp": d_tp,
            "layers": layers, "blocks": blocks, "group": group, "src": src, "dst": dst, **extra}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    d_procs = [subprocess.Popen([sys.executable, PEER, "d", str(r), json.dumps(spec)],
                                stdout=subprocess.PIPE, text=True,
                                env=dict(env, CUDA_VISIBLE_DEVICES=gpu_of("d", r)))
               for r in range(d_tp)]
    # P ranks start beside D's (their imports and engine set-up overlap D's) and get D's
    # endpoints on stdin once every D rank has printed its own
    p_procs = [subprocess.Popen([sys.executable, PEER, "p", str(r), json.dumps(spec), "-"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=dict(env, CUDA_VISIBLE_DEVICES=gpu_of("p", r)))
               for r in range(p_tp)]
    try:
        endpoints = []
        for d in d_procs:
            line = d.stdout.readline()
            while line and not line.startswith("{"):  # engines may log to stdout first
                line = d.stdout.readline()
            endpoints.append(json.loads(line)["endpoint"])
        for p in p_procs:  # every P rank at once: D acknowledges a transfer once all sent
            p.stdin.write(",".join(endpoints) + "\n")
            p.stdin.flush()
        p_res = []
        for p in p_procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            p_res.append(json.loads(out.strip().splitlines()[-1]))
        d_res = [json.loads(d.communicate(timeout=300)[0].strip().splitlines()[-1])
                 for d in d_procs]
    finally:
        for proc in (*d_procs, *p_procs):
            proc.kill()
    RESULTS.append({"transport": transport, "heads": heads, "p_tp": p_tp, "d_tp": d_tp,
                    "blocks": n, "extra": extra, "p": p_res, "d": d_res})
    out_path = os.environ.get("LAYERKV_GPU_RESULTS")
    if out_path:
        Path(out_path).write_text(json.dumps(RESULTS, indent=1))
    return p_res, d_res


def assert_exact(p_res: list, d_res: list) -> None:
    assert all(p["state"] == "acked" for p in p_res), [p["state"] for p in p_res]
    for d in d_res:
        assert d["failed"] == [] and d["finished"] == ["req-0"], d
        assert d["mismatched_blocks"] == 0, d
        assert d["untouched_ok"], d


def test_p_tp2_to_d_tp1_through_the_cuda_ipc_ring() -> None:
    """4K tokens of Llama-8B KV: each P rank's 4 heads of 256 blocks x 32 layers (256 MiB) go
    as one gathered write per group of 4 layers into D's ring."""
    p_res, d_res = run_ranks("auto", heads=8, p_tp=2, d_tp=1)
    # auto: CUDA IPC first (a network engine, when installed, follows it: "tcp+cuda_ipc+nixl")
    assert all(p["direct"] and p["transport"].startswith("tcp+cuda_ipc") for p in p_res), p_res
    assert_exact(p_res, d_res)
    assert [p["ops"] for p in p_res] == [8, 8]


def test_p_tp1_to_d_tp2_through_the_cuda_ipc_ring() -> None:
    p_res, d_res = run_ranks("auto", heads=8, p_tp=1, d_tp=2)
    assert p_res[0]["direct"]
    assert_exact(p_res, d_res)
    assert p_res[0]["ops"] == 2 * 8  # one write per (group, decode rank)


def test_gqa_replication_two_heads_to_four_decode_ranks() -> None:
    """2 KV heads, D TP4: ranks 0-1 hold head 0, ranks 2-3 head 1; P TP1 sends each its head."""
    p_res, d_res = run_ranks("auto", heads=2, p_tp=1, d_tp=4, n=64)
    assert_exact(p_res, d_res)


def test_tcp_gathers_on_the_gpu_and_sends_bytes() -> None:
    p_res, d_res = run_ranks("tcp", heads=8, p_tp=2, d_tp=1)
    assert not any(p["direct"] for p in p_res)
    assert_exact(p_res, d_res)
    assert [p["ops"] for p in p_res] == [8, 8]


def _engine(module: str) -> None:
    """Skip when an optional engine is missing."""
    try:
        __import__(module)
    except ImportError as e:
        skip(f"{module} is not installed ({e})", __name__)


def test_p_tp2_to_d_tp1_through_a_nixl_ring() -> None:
    """Forced NIXL (UCX picks CUDA IPC or copies between the GPUs): D registers its ring with
    its agent, each P rank its staging buffers, one WRITE per group of 4 layers."""
    _engine("nixl")
    p_res, d_res = run_ranks("nixl", heads=8, p_tp=2, d_tp=1)
    assert all(p["ring"] and p["transport"] == "tcp+nixl" for p in p_res), p_res
    assert_exact(p_res, d_res)
    assert [p["ops"] for p in p_res] == [8, 8]


def test_p_tp1_to_d_tp2_through_a_mooncake_ring() -> None:
    """Forced Mooncake (tcp protocol; GPU memory): each D rank registers a ring with its
    engine, P writes one gathered slice per (group, decode rank)."""
    _engine("mooncake.engine")
    p_res, d_res = run_ranks("mooncake", heads=8, p_tp=1, d_tp=2)
    assert p_res[0]["ring"] and p_res[0]["transport"] == "tcp+mooncake", p_res
    assert_exact(p_res, d_res)
    assert p_res[0]["ops"] == 2 * 8


def test_staging_cuts_transfer_operations_at_least_tenfold() -> None:
    """The same 64 blocks with and without staging: one write per group vs per (layer, block)."""
    staged, d1 = run_ranks("auto", heads=8, p_tp=2, d_tp=1, n=64)
    unstaged, d2 = run_ranks("auto", heads=8, p_tp=2, d_tp=1, n=64, tp_staging=False)
    assert_exact(staged, d1)
    assert_exact(unstaged, d2)
    ops_staged = sum(p["ops"] for p in staged)
    ops_unstaged = sum(p["ops"] for p in unstaged)
    assert ops_staged == 2 * 8 and ops_unstaged == 2 * 32 * 64
    assert ops_unstaged >= 10 * ops_staged


@(pytest.mark.parametrize("head_bytes", [8192, 6, 1]) if pytest else (lambda f: f))
def test_fused_gather_and_scatter_match_torch(head_bytes: int) -> None:
    """staging.gather / scatter through the Triton kernel against plain indexing, including
    slice sizes and offsets that force narrower words; every byte of the caches checked."""
    from vllm_layerkv.kv import fused_copy, staging

    assert fused_copy.available(torch.device("cuda")), "Triton is not importable here"
    heads, layers, blocks = 8, 6, 300
    caches = [torch.randint(0, 256, (blocks, heads * head_bytes), dtype=torch.uint8,
                            device="cuda") for _ in range(layers)]
    picked, ids = [1, 2, 5], [7, 3, 299, 0, 150, 151]
    first, count = 3, 4
    buf = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    got = staging.gather(caches, picked, ids, first, count, heads, buf)
    want = torch.cat([caches[i].view(blocks, heads, head_bytes)[ids, first:first + count]
                      .reshape(-1) for i in picked])
    assert torch.equal(got, want)
    poisoned = [torch.full_like(c, 0x5A) for c in caches]
    staging.scatter(want.clone(), poisoned, picked, ids, first, count, heads)
    for i in range(layers):
        expect = torch.full_like(caches[i], 0x5A).view(blocks, heads, head_bytes)
        if i in picked:
            expect[ids, first:first + count] = caches[i].view(blocks, heads, head_bytes)[
                ids, first:first + count]
        assert torch.equal(poisoned[i].view(blocks, heads, head_bytes), expect), i
    assert not fused_copy._broken


def test_warm_up_compiles_every_variant_a_request_needs() -> None:
    """``fused_copy.warm_up`` (start-up with ``host_bounce``) leaves nothing for a request to
    compile: whole-block copies of any block count after it add no kernel to Triton's
    cache."""
    from vllm_layerkv.kv import fused_copy, staging

    caches_of = getattr(fused_copy._copy_slices, "device_caches", None)
    if caches_of is None:
        skip("this Triton keeps no device_caches to count kernels in", __name__)

    def compiled() -> int:
        return sum(len(entry[0]) for entry in caches_of.values())

    block_bytes = 65536  # Llama-3.1-8B: 2 x 16 tokens x 8 heads x 128 x 2 B
    for to_buf in (True, False):
        assert fused_copy.warm_up(block_bytes, torch.device("cuda"), to_buf) == 3
    warm = compiled()
    caches = [torch.zeros(600, block_bytes, dtype=torch.uint8, device="cuda")
              for _ in range(4)]
    buf = torch.empty(4 * 512 * block_bytes, dtype=torch.uint8, device="cuda")
    for count in (1, 2, 5, 16, 32, 100, 512):
        ids = list(range(count))
        payload = staging.gather(caches, [0, 1, 2, 3], ids, 0, 8, 8, buf)
        staging.scatter(payload, caches, [0, 1, 2, 3], ids, 0, 8, 8)
    torch.cuda.synchronize()
    assert compiled() == warm, f"{compiled() - warm} kernels compiled after the warm-up"


if __name__ == "__main__":
    failed = run_as_script(globals(), {
        "test_fused_gather_and_scatter_match_torch": [(8192,), (6,), (1,)]})
    for r in RESULTS:
        gbps = [round(p["nbytes"] / p["seconds"] / 1e9, 2) for p in r["p"]]
        print(json.dumps({k: r[k] for k in ("transport", "heads", "p_tp", "d_tp", "blocks",
                                            "extra")}), "ops", [p["ops"] for p in r["p"]],
              "GB/s per P rank", gbps, flush=True)
    sys.exit(1 if failed else 0)

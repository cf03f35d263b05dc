"""Direct writes into device memory between two real processes on one host (GPU only): CUDA
IPC, NIXL (UCX CUDA IPC and UCX over tcp) and Mooncake (tcp), plus TCP through pinned staging.

P runs on one GPU, D on another (each sees only its own through CUDA_VISIBLE_DEVICES, as
``vllm serve`` instances do); with one GPU both share it. Each case checks every copied block
byte for byte and that no other block of D was touched. Set LAYERKV_GPU_RESULTS=path.json to keep
the measured copy rates. Skipped where CUDA is not available (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_skip import run_as_script, skip

try:
    import pytest
except ImportError:  # the GPU image has no pytest: run this file as a script (bottom)
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PEER = str(Path(__file__).with_name("ipc_peer.py"))
BLOCK_BYTES = 16 * 8 * 128 * 2 * 2  # Llama-3.1-8B: 16 tokens x 8 KV heads x 128 x (K,V) x bf16
RESULTS: list[dict] = []


def gpus() -> tuple[str, str]:
    n = torch.cuda.device_count()
    return ("0", "1") if n >= 2 else ("0", "0")


def run_pair(transport: str, transfers: list[dict], layers: int = 32, blocks: int = 1024,
             group: int = 4, env_extra: dict[str, str] | None = None,
             config: dict | None = None, warmup: bool = False) -> tuple[dict, dict]:
    """``config``: LayerKV settings for both sides' transports (e.g. nixl_num_threads);
    ``warmup``: the first transfer opens the connection and is not timed."""
    spec = {"transport": transport, "transfers": transfers, "layers": layers, "blocks": blocks,
            "block_bytes": BLOCK_BYTES, "group": group, "config": config or {},
            "warmup": warmup}
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    d, endpoint = start_decode(spec, env)
    try:
        p = run_prefill(spec, endpoint, env)
        assert p.returncode == 0, p.stderr[-3000:]
        d_out, _ = d.communicate(timeout=300)
    finally:
        d.kill()
    p_res = json.loads(p.stdout.strip().splitlines()[-1])
    d_res = json.loads(d_out.strip().splitlines()[-1])
    RESULTS.append({"transport": transport, "env": env_extra or {}, "config": config or {},
                    "gpus": "->".join(gpus()), "p": p_res, "d": d_res})
    out = os.environ.get("LAYERKV_GPU_RESULTS")
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1))
    return p_res, d_res


def start_decode(spec: dict, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """D's peer process on D's GPU, and the endpoint it listens on."""
    d = subprocess.Popen([sys.executable, PEER, "d", json.dumps(spec)], stdout=subprocess.PIPE,
                         text=True, env=dict(env, CUDA_VISIBLE_DEVICES=gpus()[1]))
    line = d.stdout.readline()
    while line and not line.startswith("{"):  # engines (NIXL) may log to stdout first
        line = d.stdout.readline()
    if not line:
        d.kill()
        raise AssertionError("the decode peer exited before it listened")
    return d, json.loads(line)["endpoint"]


def run_prefill(spec: dict, endpoint: str, env: dict[str, str]
                ) -> subprocess.CompletedProcess[str]:
    """P's peer process on P's GPU, to its end."""
    return subprocess.run([sys.executable, PEER, "p", json.dumps(spec), endpoint],
                          capture_output=True, text=True, timeout=300,
                          env=dict(env, CUDA_VISIBLE_DEVICES=gpus()[0]))


def contiguous(n: int, at: int = 0, dst_at: int = 500) -> dict:
    return {"src": list(range(at, at + n)), "dst": list(range(dst_at, dst_at + n))}


def assert_exact(d_res: dict, count: int) -> None:
    assert d_res["failed"] == []
    assert len(d_res["finished"]) == count
    assert d_res["mismatched_blocks"] == 0
    assert d_res["untouched_ok"]


def test_auto_copies_device_to_device_byte_exact() -> None:
    """4K tokens of Llama-8B KV (256 blocks x 32 layers = 512 MiB) in 8 layer groups."""
    p_res, d_res = run_pair("auto", [contiguous(256)])
    # auto: CUDA IPC first, then NIXL / Mooncake when installed, then bytes; D reads by default
    assert p_res["direct"] and p_res["transport"].startswith("tcp+cuda_ipc")
    assert p_res["reads"]
    assert all(s == "acked" for s in p_res["states"].values()), p_res["states"]
    assert_exact(d_res, 1)


def test_scattered_blocks_use_the_gather_path() -> None:
    src = list(range(0, 600, 3))[:150]
    dst = list(range(1000, 400, -4))[:150]
    p_res, d_res = run_pair("cuda_ipc", [{"src": src, "dst": dst}, contiguous(40, 700, 10)],
                            config={"cuda_ipc_reads": False})  # P writes: its gather path
    assert p_res["direct"] and not p_res["reads"]
    assert_exact(d_res, 2)


def test_decode_reads_copies_device_to_device_byte_exact() -> None:
    """cuda_ipc_reads: D maps P's KV and copies each group itself (contiguous and scattered
    blocks)."""
    src = list(range(0, 600, 3))[:150]
    dst = list(range(1000, 400, -4))[:150]
    # D's blocks of the two transfers are disjoint (the check compares each with P's)
    p_res, d_res = run_pair("cuda_ipc", [contiguous(256, dst_at=0), {"src": src, "dst": dst}],
                            config={"cuda_ipc_reads": True})
    assert p_res["direct"] and p_res["reads"]
    assert all(s == "acked" for s in p_res["states"].values()), p_res["states"]
    assert_exact(d_res, 2)


def test_prefill_killed_while_decode_reads_fails_only_its_transfer() -> None:
    """With D reading, P is killed right after it has announced three layer groups of a
    2,000-block transfer (D may still be copying from P's memory). D fails that transfer,
    keeps a working CUDA context, lets go of the dead P's memory (P's GPU gets it back), and
    then receives another P's transfer byte for byte."""
    if torch.cuda.device_count() < 2:
        skip("needs two GPUs: P's memory is checked on a GPU of its own", __name__)
    spec = {"transport": "cuda_ipc", "layers": 32, "blocks": 2400, "block_bytes": BLOCK_BYTES,
            "group": 4, "config": {"cuda_ipc_reads": True}, "warmup": False,
            "transfers": [contiguous(2000, 0, 0), contiguous(256, 0, 2100)]}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    free_before, _ = torch.cuda.mem_get_info(0)
    d, endpoint = start_decode(spec, env)
    try:
        dying = run_prefill({**spec, "send": [0], "die_after_groups": 3}, endpoint, env)
        assert dying.returncode == -9, dying.stderr[-3000:]
        assert json.loads(dying.stdout.strip().splitlines()[-1])["groups_sent"] == 3
        t_dead = time.monotonic()  # P's 2.4 GiB of KV, no longer mapped by D
        while torch.cuda.mem_get_info(0)[0] < free_before - (256 << 20):
            assert time.monotonic() < t_dead + 30, "the dead prefill's memory was not released"
            time.sleep(0.05)
        released_s = time.monotonic() - t_dead
        healthy = run_prefill({**spec, "send": [1]}, endpoint, env)
        assert healthy.returncode == 0, healthy.stderr[-3000:]
        p_res = json.loads(healthy.stdout.strip().splitlines()[-1])
        d_out, _ = d.communicate(timeout=300)
    finally:
        d.kill()
    d_res = json.loads(d_out.strip().splitlines()[-1])
    RESULTS.append({"case": "prefill killed while decode reads", "released_s": released_s,
                    "p": p_res, "d": d_res})
    assert p_res["reads"] and p_res["states"] == {"tid-1": "acked"}, p_res
    assert d_res["failed"] == ["req-0"] and d_res["finished"] == ["req-1"], d_res
    assert d_res["mismatched_blocks"] == 0 and d_res["untouched_ok"], d_res
    assert d_res["cuda_ok"], d_res


def test_tcp_forced_sends_bytes_through_pinned_staging() -> None:
    p_res, d_res = run_pair("tcp", [contiguous(256)])
    assert not p_res["direct"] and p_res["transport"] == "tcp"
    assert_exact(d_res, 1)


# ------------------------------------------------------------ NIXL / Mooncake on device memory


def test_nixl_writes_vram_byte_exact() -> None:
    """UCX's default transports (CUDA IPC between GPUs of one host)."""
    if torch.cuda.device_count() < 2:
        skip("needs two GPUs (test_nixl_on_one_gpu_fails_saying_what_to_use covers one)",
             __name__)
    p_res, d_res = run_pair("nixl", [contiguous(256), {"src": list(range(0, 120, 3)),
                                                       "dst": list(range(900, 780, -3))}])
    assert p_res["direct"] and p_res["transport"] == "tcp+nixl"
    assert all(s == "acked" for s in p_res["states"].values()), p_res["states"]
    assert_exact(d_res, 2)


def test_nixl_on_one_gpu_fails_saying_what_to_use() -> None:
    """P and D on one GPU, UCX's defaults: UCX's cuda_ipc fails its copy between the two
    processes (benchmarks/results/2026-11-24-h200-shared-load-nixl). The transfer fails, and
    its reason says what to change."""
    if torch.cuda.device_count() != 1:
        skip("needs P and D on one GPU", __name__)
    p_res, _ = run_pair("nixl", [contiguous(16)])
    (state,) = p_res["states"].values()
    assert state != "acked" and "share one GPU" in state and "transport=auto" in state, state


def test_nixl_over_ucx_tcp_byte_exact() -> None:
    p_res, d_res = run_pair("nixl", [contiguous(256)],
                            env_extra={"UCX_TLS": "tcp,cuda_copy,self"})
    assert p_res["direct"]
    assert_exact(d_res, 1)


def nixl_over_ucx_tcp_2gib(threads: int, host_bounce: str, writes_in_flight: int = 2) -> None:
    """16K tokens of KV (1,000 blocks x 32 layers = 2 GiB) in 8 layer groups over UCX tcp,
    after a warm-up transfer (300 blocks: two staging buffers' worth per group) that opens the
    connection and is not timed."""
    warm = contiguous(300, 1000, 1010)
    p_res, d_res = run_pair("nixl", [warm, contiguous(1000, 0, 10)], blocks=1400,
                            env_extra={"UCX_TLS": "tcp,cuda_copy,self"},
                            config={"nixl_num_threads": threads, "host_bounce": host_bounce,
                                    "staging_buffers": max(2, writes_in_flight),
                                    "writes_in_flight": writes_in_flight}, warmup=True)
    assert p_res["direct"]
    # "auto" bounces here: this UCX_TLS leaves UCX no transport that reaches GPU memory
    assert p_res["bounces"] == (host_bounce != "off")
    assert_exact(d_res, 2)


def test_nixl_over_ucx_tcp_one_worker() -> None:
    nixl_over_ucx_tcp_2gib(0, "off")


def test_nixl_over_ucx_tcp_thread_pool() -> None:
    """NIXL's thread-pool UCX engine (nixl_num_threads=4, NixlConnector's default)."""
    nixl_over_ucx_tcp_2gib(4, "off")


def test_nixl_over_ucx_tcp_through_host_memory() -> None:
    """``host_bounce`` (auto): UCX moves pinned host memory, LayerKV copies to and from the
    GPUs."""
    nixl_over_ucx_tcp_2gib(0, "auto")


def test_nixl_over_ucx_tcp_through_host_memory_one_write_at_a_time() -> None:
    """The same with ``writes_in_flight=1``: each piece gathered, copied out, written, copied
    in and scattered before the next starts (what the first host_bounce version did)."""
    nixl_over_ucx_tcp_2gib(0, "auto", writes_in_flight=1)


def test_nixl_over_ucx_tcp_through_host_memory_three_writes_in_flight() -> None:
    nixl_over_ucx_tcp_2gib(0, "auto", writes_in_flight=3)


def test_mooncake_tcp_through_host_memory() -> None:
    p_res, d_res = run_pair("mooncake", [contiguous(1000, 0, 10)],
                            config={"host_bounce": "on"})
    assert p_res["direct"] and p_res["bounces"]
    assert_exact(d_res, 1)


def test_mooncake_tcp_2gib() -> None:
    p_res, d_res = run_pair("mooncake", [contiguous(1000, 0, 10)])
    assert p_res["direct"] and not p_res["bounces"]
    assert_exact(d_res, 1)


def test_mooncake_tcp_byte_exact() -> None:
    p_res, d_res = run_pair("mooncake", [contiguous(256), {"src": list(range(0, 120, 3)),
                                                           "dst": list(range(900, 780, -3))}])
    assert p_res["direct"] and p_res["transport"] == "tcp+mooncake"
    assert_exact(d_res, 2)


if __name__ == "__main__":
    failed = run_as_script(globals())
    print(json.dumps(RESULTS, indent=1))
    sys.exit(1 if failed else 0)

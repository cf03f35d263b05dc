"""benchmarks/decode_profile.py: a decode instance's steps split into GPU busy time and idle gaps
per CUDA-graph launch, on a simulated trace whose steps, kernels and gaps are known."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmark_scripts import load

decode_profile = load("decode_profile")

GEMM, ATTN = "nvjet_tst_128x64_64x4_1x1_v_bz_TNT", "flash_fwd_splitkv_kernel"


def simulated_steps(steps: int, gap_us: float, gemm_us: float = 30.0,
                    attn_us: float = 10.0) -> list[dict]:
    """One graph launch per step; each step two GEMMs and one attention kernel back to back on
    stream 7, then ``gap_us`` idle before the next step. A copy on another stream, and a CPU op,
    must not count."""
    events, t = [], 1000.0
    for _ in range(steps):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch",
                       "ts": t, "dur": 4.0, "pid": 1, "tid": 1})
        for name, dur in ((GEMM, gemm_us), (ATTN, attn_us), (GEMM, gemm_us)):
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur,
                           "pid": 0, "tid": 7})
            t += dur
        t += gap_us
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 1000.0,
                   "dur": 5.0, "pid": 0, "tid": 9})
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1000.0, "dur": 1e6,
                   "pid": 1, "tid": 1})
    events.append({"ph": "i", "name": "marker", "ts": 0})  # not a complete event
    return events


def test_busy_and_idle_per_launch_come_from_the_forward_stream() -> None:
    s = decode_profile.summarize(simulated_steps(10, gap_us=200.0))
    assert s["graph_launches"] == 10
    assert s["busy_per_launch_ms"] == pytest.approx(0.070)
    # 9 gaps of 200 us between 10 steps
    assert s["idle_ms"] == pytest.approx(1.8)
    assert s["gaps"]["100-1000us"] == {"count": 9, "ms": 1.8}
    assert s["gaps"]["0-5us"]["count"] == 0
    assert s["classes"]["gemm"] == {"count": 20, "ms": 0.6, "mean_us": 30.0}
    assert s["classes"]["attention"]["mean_us"] == 10.0
    assert s["other_streams"] == 1
    assert s["top_kernels"][0]["name"] == GEMM


def test_slower_kernels_and_longer_gaps_are_told_apart() -> None:
    base = decode_profile.summarize(simulated_steps(20, gap_us=50.0))
    slow_gpu = decode_profile.summarize(simulated_steps(20, gap_us=50.0, gemm_us=33.0))
    slow_host = decode_profile.summarize(simulated_steps(20, gap_us=110.0))
    assert slow_gpu["busy_per_launch_ms"] > base["busy_per_launch_ms"]
    assert slow_gpu["idle_per_launch_ms"] == base["idle_per_launch_ms"]
    assert slow_host["busy_per_launch_ms"] == base["busy_per_launch_ms"]
    assert slow_host["idle_per_launch_ms"] > base["idle_per_launch_ms"]


def test_overlapping_kernels_count_once() -> None:
    busy, gaps = decode_profile.busy_and_gaps([(0.0, 10.0), (5.0, 10.0), (30.0, 5.0)])
    assert busy == 20.0 and gaps == [15.0]


def test_a_trace_without_gpu_kernels_is_refused_with_the_reason(tmp_path: Path,
                                                                capsys) -> None:
    cpu_only = [e for e in simulated_steps(3, 10.0) if e.get("cat") == "cpu_op"]
    path = tmp_path / "cpu.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": cpu_only}))
    assert decode_profile.main([str(path)]) == 2
    assert "no GPU kernels in the trace" in capsys.readouterr().err


def test_the_command_reads_gzipped_traces_and_writes_a_table_and_json(tmp_path: Path,
                                                                       capsys) -> None:
    paths = []
    for name, gap in (("nixl", 50.0), ("layerkv", 90.0)):
        path = tmp_path / f"{name}.pt.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": simulated_steps(5, gap)}, f)
        paths.append(str(path))
    out = tmp_path / "summary.json"
    assert decode_profile.main([*paths, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| trace | window ms | graph launches |" in printed and "layerkv" in printed
    summaries = json.loads(out.read_text())
    assert [s["idle_per_launch_ms"] for s in summaries.values()] == [0.04, 0.072]


def correlated_steps(steps: int, inner_gap_us: float | tuple[float, float],
                     launch_lead_us: float, between_us: float = 20.0) -> list[dict]:
    """One graph launch per step with three kernels that carry its correlation id,
    ``inner_gap_us`` apart (or, as a pair, the gap after the first and after the second;
    negative: the next kernel starts before the previous ends); the host calls
    cudaGraphLaunch ``launch_lead_us`` before the graph's first kernel, and ``between_us`` of
    GPU idle time separate the steps. Each step's input copy runs before its graph, outside it."""
    events, t = [], 1000.0
    for step in range(steps):
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": t,
                       "dur": 2.0, "pid": 0, "tid": 7, "args": {"correlation": 10_000 + step}})
        t += 2.0 + between_us
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch",
                       "ts": t - launch_lead_us, "dur": 5.0, "pid": 1, "tid": 1,
                       "args": {"correlation": step}})
        gaps = inner_gap_us if isinstance(inner_gap_us, tuple) else (inner_gap_us,) * 2
        for name, dur, gap in ((GEMM, 30.0, gaps[0]), (ATTN, 10.0, gaps[1]), (GEMM, 30.0, 0.0)):
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur,
                           "pid": 0, "tid": 7, "args": {"correlation": step}})
            t += dur + gap
    return events


def test_per_launch_separates_gaps_inside_a_graph_from_a_late_host() -> None:
    ahead = decode_profile.per_launch(correlated_steps(10, inner_gap_us=0.5,
                                                       launch_lead_us=2000.0))
    assert ahead["launches"] == 10
    assert ahead["busy_us"] == 70.0 and ahead["span_us"] == 71.0
    assert ahead["inner_idle_us"] == 1.0  # two gaps of 0.5 us inside each graph
    assert ahead["idle_before_us"] == 20.0  # after the input copy, before the graph
    assert ahead["launch_to_kernel_us"] == 2000.0
    assert ahead["host_late_us"] < 0 and ahead["host_late_share"] == 0.0
    wider = decode_profile.per_launch(correlated_steps(10, inner_gap_us=2.5,
                                                       launch_lead_us=2000.0))
    assert wider["inner_idle_us"] == 5.0 and wider["busy_us"] == 70.0
    late = decode_profile.per_launch(correlated_steps(10, inner_gap_us=0.5,
                                                      launch_lead_us=5.0))
    # the call came 15 us after the input copy ended: the GPU waited for the host
    assert late["host_late_us"] == 15.0 and late["host_late_share"] == 1.0
    assert late["launch_to_kernel_us"] == 5.0


def test_per_launch_needs_correlated_graph_launches() -> None:
    assert decode_profile.per_launch(simulated_steps(5, gap_us=50.0)) is None
    assert decode_profile.summarize(simulated_steps(5, gap_us=50.0))["per_launch"] is None


def test_boundaries_show_each_kernel_pairs_gap_and_overlaps() -> None:
    """Same kernels, same busy time: one graph overlaps GEMM -> attention by 0.5 us, the other
    waits 0.4 us there; the boundary list tells them apart, pair by pair."""
    overlapping = decode_profile.per_launch(correlated_steps(10, inner_gap_us=(-0.5, 0.25),
                                                             launch_lead_us=2000.0))
    assert overlapping["overlap_share"] == 0.5
    first, second = overlapping["boundaries"]
    assert (first["from"], first["to"]) == (ATTN, GEMM)  # equal counts: by name
    assert first == {"from": ATTN, "to": GEMM, "count": 10, "median_us": 0.25,
                     "overlap_share": 0.0}
    assert second == {"from": GEMM, "to": ATTN, "count": 10, "median_us": -0.5,
                      "overlap_share": 1.0}
    waiting = decode_profile.per_launch(correlated_steps(10, inner_gap_us=(0.4, 0.25),
                                                         launch_lead_us=2000.0))
    assert waiting["overlap_share"] == 0.0
    assert [b["median_us"] for b in waiting["boundaries"]] == [0.25, 0.4]
    long_name = "k" * 200
    events = correlated_steps(2, inner_gap_us=0.5, launch_lead_us=100.0)
    for e in events:
        if e.get("name") == ATTN:
            e["name"] = long_name
    names = {b["to"] for b in decode_profile.per_launch(events)["boundaries"]}
    assert "k" * decode_profile.NAME_CHARS in names

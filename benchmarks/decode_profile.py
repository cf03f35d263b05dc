"""Where a decode instance's steps go, from torch-profiler traces of it (vLLM's /start_profile,
``gpu_bench.sh TORCH_PROFILE_POINTS``): how long the GPU ran kernels and how long it sat idle
per CUDA-graph launch, and which kernels took the time.

Two decode instances whose steps differ in length differ either in their kernels (the GPU did
more, or the same work more slowly) or in the gaps between them: between graphs (the GPU
waited for the host) or inside one (the GPU's own gaps from one kernel to the next). This
tells them apart:

* the **stream** is the CUDA stream with the most kernel time (vLLM's forward);
* **busy** is the union of that stream's kernel, memcpy and memset intervals, **idle** the rest
  of the window from its first kernel to its last; **gaps** are the idle intervals, by length;
* **steps** are the ``cudaGraphLaunch`` calls in the window (one per decode step with FULL CUDA
  graphs; eager or PIECEWISE steps launch more, or none);
* kernels are grouped into attention, GEMM, copies and the rest by name;
* **per launch**: each graph's kernels found by their launch's correlation id, so idle time
  *inside* a graph (its kernels' launch gaps) is told apart from idle time *before* it, and a
  host that called ``cudaGraphLaunch`` after the GPU had run dry from one that was ahead;
* **boundaries**: inside the graphs, the gap from each kernel to the next by the pair of kernel
  names (negative: the next one started before the previous ended), so two instances running
  the same graph can be compared boundary by boundary.

    python3 benchmarks/decode_profile.py TRACE.pt.trace.json.gz ... [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_BUCKETS_US = ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf")))
BOUNDARIES_SHOWN = 8
"""Kernel boundaries listed per trace, the most frequent first."""
NAME_CHARS = 48
"""A kernel's name is cut to this many characters in the boundary list."""


def load_events(path: Path) -> list[dict[str, Any]]:
    """The complete events (``ph: X``) of a Chrome-format trace, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "matmul", "xmma", "splitk")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Union length of (start, duration) intervals, and the idle gaps between them (us)."""
    busy, gaps = 0.0, []
    end = None
    for start, dur in sorted(intervals):
        if end is not None and start > end:
            gaps.append(start - end)
        lo = start if end is None else max(start, end)
        busy += max(0.0, start + dur - lo)
        end = start + dur if end is None else max(end, start + dur)
    return busy, gaps


def summarize(events: list[dict[str, Any]], top: int = 10) -> dict[str, Any]:
    """The per-step picture of one trace (times in ms, means per kernel in us)."""
    streams: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            streams[(e.get("pid"), e.get("tid"))].append(e)
    if not streams:
        raise ValueError("no GPU kernels in the trace (was it recorded on a CPU instance, or "
                         "with the CUDA activity off?)")
    stream = max(streams.values(), key=lambda es: sum(e["dur"] for e in es))
    first = min(e["ts"] for e in stream)
    last = max(e["ts"] + e["dur"] for e in stream)
    busy, gaps = busy_and_gaps([(e["ts"], e["dur"]) for e in stream])
    launches = sum(1 for e in events if e.get("cat") == "cuda_runtime"
                   and e.get("name") == "cudaGraphLaunch" and first <= e["ts"] <= last)
    steps = max(launches, 1)
    classes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in stream:
        for table, key in ((classes, kernel_class(e["name"])), (names, e["name"])):
            table[key][0] += 1
            table[key][1] += e["dur"]
    window = last - first
    return {
        "window_ms": round(window / 1e3, 2),
        "graph_launches": launches,
        "busy_ms": round(busy / 1e3, 2),
        "idle_ms": round((window - busy) / 1e3, 2),
        "busy_per_launch_ms": round(busy / steps / 1e3, 3),
        "idle_per_launch_ms": round((window - busy) / steps / 1e3, 3),
        "gaps": {f"{lo:g}-{hi:g}us": {"count": sum(lo <= g < hi for g in gaps),
                                        "ms": round(sum(g for g in gaps if lo <= g < hi) / 1e3, 2)}
                 for lo, hi in GAP_BUCKETS_US},
        "classes": {k: {"count": int(n), "ms": round(t / 1e3, 2), "mean_us": round(t / n, 2)}
                    for k, (n, t) in sorted(classes.items())},
        "top_kernels": [{"name": k[:100], "count": int(n), "ms": round(t / 1e3, 2),
                         "mean_us": round(t / n, 2)}
                        for k, (n, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]],
        "other_streams": len(streams) - 1,
        "per_launch": per_launch(events),
    }


def per_launch(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each CUDA-graph launch on the GPU and on the host, matched by the profiler's correlation
    id (every kernel of a graph carries its ``cudaGraphLaunch``'s). Per launch: the graph's span
    on the GPU from its first kernel to its last, the part of that span with no kernel running
    (``inner_idle``: the graph's own dependencies and launch gaps), the GPU's idle time before
    the graph since its last activity of any kind (``idle_before``), and the host's side of
    that idle time: when the host called ``cudaGraphLaunch`` against when the GPU ran out of
    work (``host_late``: positive when the call came after the GPU went idle, so the GPU waited
    for the host) and how long after that call the first kernel ran (``launch_to_kernel``).
    Medians in us over the launches; None if the trace has no correlated graph launches."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"
                and "correlation" in e.get("args", {})}
    if not launches:
        return None
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    kernels: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        if corr in launches:
            kernels[corr].append(e)
    graphs = sorted((min(e["ts"] for e in ks), corr) for corr, ks in kernels.items())
    if not graphs:
        return None
    rows: dict[str, list[float]] = defaultdict(list)
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    gpu_ends = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    i, latest_end = 0, None
    for start, corr in graphs:
        ks = kernels[corr]
        end = max(e["ts"] + e["dur"] for e in ks)
        busy, _ = busy_and_gaps([(e["ts"], e["dur"]) for e in ks])
        rows["span"].append(end - start)
        rows["busy"].append(busy)
        rows["inner_idle"].append(end - start - busy)
        for a, b in zip(ks, ks[1:]):  # in start order, as ``gpu`` is
            pairs[(a["name"][:NAME_CHARS], b["name"][:NAME_CHARS])].append(
                b["ts"] - (a["ts"] + a["dur"]))
        while i < len(gpu_ends) and gpu_ends[i][0] < start:  # GPU work begun before the graph
            latest_end = gpu_ends[i][1] if latest_end is None else max(latest_end, gpu_ends[i][1])
            i += 1
        call = launches[corr]
        rows["launch_to_kernel"].append(start - call["ts"])
        if latest_end is not None:
            rows["idle_before"].append(max(0.0, start - latest_end))
            rows["host_late"].append(call["ts"] - latest_end)
    out: dict[str, Any] = {"launches": len(graphs)}
    for key in ("span", "busy", "inner_idle", "idle_before", "host_late", "launch_to_kernel"):
        out[f"{key}_us"] = round(statistics.median(rows[key]), 1) if rows[key] else None
    late = rows["host_late"]
    out["host_late_share"] = round(sum(x > 0 for x in late) / len(late), 3) if late else None
    out["mean_idle_before_us"] = (round(sum(rows["idle_before"]) / len(rows["idle_before"]), 1)
                                  if rows["idle_before"] else None)
    out["mean_inner_idle_us"] = round(sum(rows["inner_idle"]) / len(rows["inner_idle"]), 1)
    out.update(boundaries(pairs))
    return out


def boundaries(pairs: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    """From each (kernel, next kernel) pair's gaps inside the graphs: the share of all
    boundaries at which the next kernel started before the previous one ended
    (``overlap_share``), and the most frequent pairs with their median gap (us) and their own
    overlap share."""
    every = [g for gaps in pairs.values() for g in gaps]
    shown = sorted(pairs.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:BOUNDARIES_SHOWN]
    return {
        "overlap_share": round(sum(g < 0 for g in every) / len(every), 3) if every else None,
        "boundaries": [{"from": a, "to": b, "count": len(gaps),
                        "median_us": round(statistics.median(gaps), 3),
                        "overlap_share": round(sum(g < 0 for g in gaps) / len(gaps), 3)}
                       for (a, b), gaps in shown],
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    """One markdown row per trace."""
    head = ("| trace | window ms | graph launches | GPU busy per launch ms | idle per launch ms "
            "| gaps >= 100 us (count, ms) | GEMM mean us | attention mean us |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, s in rows.items():
        long = [v for k, v in s["gaps"].items() if k in ("100-1000us", "1000-infus")]
        count, ms = sum(v["count"] for v in long), round(sum(v["ms"] for v in long), 2)
        mean = {k: s["classes"].get(k, {}).get("mean_us", "-") for k in ("gemm", "attention")}
        lines.append(f"| {name} | {s['window_ms']} | {s['graph_launches']} | "
                     f"{s['busy_per_launch_ms']} | {s['idle_per_launch_ms']} | {count}, {ms} | "
                     f"{mean['gemm']} | {mean['attention']} |")
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="also write every summary here")
    ap.add_argument("--top", type=int, default=10, help="kernels listed per trace")
    args = ap.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    for path in args.traces:
        try:
            rows[str(path)] = summarize(load_events(path), args.top)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
    print(table(rows))
    for name, s in rows.items():
        if (pl := s.get("per_launch")) is not None:
            print(f"\n{name}: per graph launch (medians, us): " + ", ".join(
                f"{k} {v}" for k, v in pl.items() if k != "boundaries"))
            for b in pl["boundaries"]:
                print(f"  {b['median_us']:7.3f} us median, {b['overlap_share']:5.1%} overlapping,"
                      f" {b['count']:6d} x  {b['from']} -> {b['to']}")
    for name, s in rows.items():
        print(f"\n{name}: top kernels")
        for k in s["top_kernels"]:
            print(f"  {k['ms']:9.2f} ms {k['count']:7d} x {k['mean_us']:8.2f} us  {k['name']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one 2 x H200 load run with LayerKV (2026-11-23-h200x2/run1/b, eager, c=16, 4K in / 128
out, 200 requests, --trace), read again from its traces: per-request TPOT over the run, as the
proxy saw it ((last byte - first byte) / 127), and how long P's CUDA IPC copies were busy.

    python benchmarks/results/2026-11-24-h200-decode-steps/run1_tpot_timeline.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / "2026-11-23-h200x2" / "run1" / "b" / "layerkv"


def events(name: str) -> list[dict]:
    return [json.loads(line) for line in (TRACES / name).read_text().splitlines()]


def main() -> None:
    by_tid: dict[str, dict[str, float]] = {}
    for e in events("trace.proxy.0"):
        by_tid.setdefault(e["transfer_id"], {})[e["ev"]] = e["t"]
    served = sorted((r for r in by_tid.values() if "proxy_d_first" in r),
                    key=lambda r: r["proxy_in"])
    load = served[-200:]  # the load point's 200 requests came last
    t0, t1 = load[0]["proxy_in"], max(r["proxy_out"] for r in load)
    tpot = [(r["proxy_out"] - r["proxy_d_first"]) / 127 * 1e3 for r in load]
    q = statistics.quantiles(tpot, n=10)
    print(f"load point: {t1 - t0:.1f} s, per-request TPOT mean {statistics.fmean(tpot):.2f} "
          f"ms, p10 {q[0]:.1f}, median {statistics.median(tpot):.1f}, p90 {q[-1]:.1f}")
    print("first token (s after the first request) : TPOT (ms), in order of arrival")
    cells = [f"{r['proxy_d_first'] - t0:5.1f}:{t:4.1f}" for r, t in zip(load, tpot)]
    for i in range(0, len(cells), 10):
        print("  ".join(cells[i:i + 10]))
    p = events("trace.p.0")
    starts = [e["t"] for e in p if e["ev"] == "group_send_start" and t0 <= e["t"] <= t1]
    ends = [e["t"] for e in p if e["ev"] == "group_send_end" and t0 <= e["t"] <= t1]
    busy = sum(b - a for a, b in zip(starts, ends))
    print(f"P's layer-group copies into D's memory: {len(starts)} groups, busy {busy:.2f} s of "
          f"{t1 - t0:.1f} s ({busy / (t1 - t0):.1%})")


if __name__ == "__main__":
    main()

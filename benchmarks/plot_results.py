"""Collect ``ttft_bench.py`` runs into one table (JSON + Markdown) and draw the plots.

Reads every ``bench.log`` under the given directories (the lines ttft_bench.py prints for each
measurement: median TTFT at c=1, mean TTFT / TPOT under load, the first request's TTFT, the
open-loop rate points' percentiles and goodput), so runs made one after the other combine into
one table. Needs matplotlib (plots only).

Usage: python benchmarks/plot_results.py RESULT_DIR [RESULT_DIR ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from png import save_png  # benchmarks/png.py, beside this script

C1 = re.compile(r"\] (\S+) in=(\d+): median TTFT ([\d.]+) ms")
LOAD = re.compile(r"\] (\S+) load c=(\d+): mean TTFT ([\d.]+) ms, mean TPOT ([\d.]+) ms"
                  r"(?:, mean E2E ([\d.]+) ms, ([\d.]+) requests/s)?")
COLD = re.compile(r"\] (\S+): first request TTFT ([\d.]+) ms, second ([\d.]+) ms")
_MS = r"([\d.]+|-)"
RATE = re.compile(r"\] (\S+) rate (\S+) \(([\d.]+) req/s, offered ([\d.]+|-)\): "
                  rf"TTFT p50/p90/p99 {_MS}/{_MS}/{_MS} ms, TPOT p50/p99 {_MS}/{_MS} ms, "
                  r"achieved ([\d.]+) requests/s, goodput ([\d.]+) requests/s")
RATE_KEYS = ("request_rate", "offered_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
             "tpot_p50_ms", "tpot_p99_ms", "achieved_rate", "goodput")


def _number(text: str) -> float | None:
    return None if text == "-" else float(text)


def collect(dirs: list[Path]) -> dict:
    c1: dict[str, dict[int, float]] = {}
    load: dict[str, dict[str, float]] = {}
    cold: dict[str, dict[str, float]] = {}
    rates: dict[str, dict[str, dict[str, float | None]]] = {}
    for d in dirs:
        for log in sorted(d.rglob("bench.log")):
            for line in log.read_text().splitlines():
                if m := C1.search(line):
                    c1.setdefault(m[1], {})[int(m[2])] = float(m[3])
                elif m := LOAD.search(line):
                    load[m[1]] = {"concurrency": int(m[2]), "mean_ttft_ms": float(m[3]),
                                  "mean_tpot_ms": float(m[4])}
                    if m[5] is not None:  # logs from 2026-11-26 on
                        load[m[1]].update(mean_e2el_ms=float(m[5]),
                                          request_throughput=float(m[6]))
                elif m := COLD.search(line):
                    cold[m[1]] = {"first_ttft_ms": float(m[2]), "second_ttft_ms": float(m[3])}
                elif m := RATE.search(line):
                    rates.setdefault(m[1], {})[m[2]] = {
                        k: _number(v) for k, v in zip(RATE_KEYS, m.groups()[2:])}
    return {"c1_median_ttft_ms": c1, "load": load, "cold_start": cold, "rates": rates}


def markdown(table: dict) -> str:
    c1 = table["c1_median_ttft_ms"]
    configs = list(c1)
    lens = sorted({n for v in c1.values() for n in v})
    lines = ["| prompt tokens | " + " | ".join(configs) + " |",
             "| --- |" + " --- |" * len(configs)]
    for n in lens:
        cells = [f"{c1[c][n]:.1f}" if n in c1[c] else "-" for c in configs]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if table["load"]:
        lines += ["", "| configuration | concurrency | mean TTFT (ms) | mean TPOT (ms) | "
                      "mean E2E (ms) | requests/s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for c, v in table["load"].items():
            e2e = f"{v['mean_e2el_ms']:.1f}" if "mean_e2el_ms" in v else "-"
            rate = f"{v['request_throughput']:.2f}" if "request_throughput" in v else "-"
            lines.append(f"| {c} | {v['concurrency']} | {v['mean_ttft_ms']:.1f} | "
                         f"{v['mean_tpot_ms']:.2f} | {e2e} | {rate} |")
    if table.get("rates"):
        lines += ["", "| configuration | rate | requests/s | TTFT p50 / p90 / p99 (ms) | "
                      "TPOT p50 / p99 (ms) | achieved requests/s | goodput requests/s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]

        def cell(v: dict[str, float | None], *keys: str, digits: int = 1) -> str:
            return " / ".join("-" if v[k] is None else f"{v[k]:.{digits}f}" for k in keys)

        for c, points in table["rates"].items():
            for label, v in points.items():
                lines.append(f"| {c} | {label} | {v['request_rate']:.2f} | "
                             f"{cell(v, 'ttft_p50_ms', 'ttft_p90_ms', 'ttft_p99_ms')} | "
                             f"{cell(v, 'tpot_p50_ms', 'tpot_p99_ms', digits=2)} | "
                             f"{v['achieved_rate']:.2f} | {v['goodput']:.2f} |")
    if table.get("cold_start"):
        lines += ["", "| configuration | first request TTFT (ms) | second request TTFT (ms) |",
                  "| --- | --- | --- |"]
        for c, v in table["cold_start"].items():
            lines.append(f"| {c} | {v['first_ttft_ms']:.1f} | {v['second_ttft_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(table: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, vals in table["c1_median_ttft_ms"].items():
        xs = sorted(vals)
        ax.plot(xs, [vals[x] for x in xs], marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT (ms), concurrency 1")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("TTFT vs prompt length")
    fig.tight_layout()
    save_png(fig, out / "ttft_vs_prompt.png", dpi=110)
    if table["load"]:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
        names = list(table["load"])
        for ax, key, label in ((axes[0], "mean_ttft_ms", "mean TTFT (ms)"),
                               (axes[1], "mean_tpot_ms", "mean TPOT (ms)")):
            ax.bar(names, [table["load"][n][key] for n in names])
            ax.set_ylabel(label)
            ax.tick_params(axis="x", rotation=20)
        c = next(iter(table["load"].values()))["concurrency"]
        fig.suptitle(f"under load (concurrency {c})")
        fig.tight_layout()
        save_png(fig, out / "load_ttft_tpot.png", dpi=110)
    if table.get("rates"):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
        for name, points in table["rates"].items():
            rows = sorted(points.values(), key=lambda v: v["request_rate"] or 0)
            xs = [v["request_rate"] for v in rows]
            axes[0].plot(xs, [v["goodput"] for v in rows], marker="o", label=name)
            axes[1].plot(xs, [v["ttft_p90_ms"] for v in rows], marker="o", label=name)
        axes[0].set_ylabel("goodput (requests/s)")
        axes[1].set_ylabel("p90 TTFT (ms)")
        for ax in axes:
            ax.set_xlabel("request rate (requests/s, Poisson)")
            ax.grid(True, alpha=0.3)
        axes[0].legend()
        fig.suptitle("open-loop rate points")
        fig.tight_layout()
        save_png(fig, out / "rates_goodput_ttft.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", type=Path, nargs="+", help="ttft_bench.py output directories")
    ap.add_argument("--out", type=Path, required=True,
                    help="where table.json, table.md and the plots go")
    args = ap.parse_args()
    table = collect(args.dirs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps(table, indent=1))
    (args.out / "table.md").write_text(markdown(table))
    print(markdown(table))
    plot(table, args.out)


if __name__ == "__main__":
    main()

"""TTFT against link rate: LayerKV over a paced TCP link (``layerkv-tcp-<N>g``) and every other
P/D configuration at its probed link rate, with the single instance and the ideal TTFT.

Reads ``summary.json`` of ttft_bench.py runs (files, or the directories that hold them) that
ran ``single`` with the P/D configurations: the ideal TTFT block (``ideal``: the fixed
overhead, the KV bytes per token, each configuration's link rate) and the c=1 medians. Draws
one panel per prompt length: each configuration's median TTFT at its link rate (Gb/s, log
scale), the single instance's TTFT as a horizontal line, and the ideal
``max(single, overhead + KV bytes / link rate)`` as a curve over the rates (ideal_ttft.py).
Writes ``link_rates.json``, ``link_rates.md`` and ``link_rates.png`` (needs matplotlib).

Usage: python benchmarks/plot_link_rates.py RUN_DIR_OR_SUMMARY [...] --out DIR
           [--prompt-lens 8192 16000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from ideal_ttft import ideal_ttft_ms  # benchmarks/ideal_ttft.py, beside this script
from png import save_png  # benchmarks/png.py, beside this script

PACED = re.compile(r"^(?P<base>.+)-(?P<gbps>\d+(?:\.\d+)?)g(?P<rest>(?:-\d+p)?(?:-tp\d+-tp\d+)?)$")


def series_of(name: str) -> str:
    """The line a configuration belongs to: paced ones share their unpaced name's."""
    m = PACED.match(name)
    return f"{m['base']}{m['rest']} (paced)" if m else name


def collect(summaries: list[dict[str, Any]], prompt_lens: list[int] | None = None
            ) -> dict[str, Any]:
    """Per prompt length: the single instance's TTFT, the ideal's terms, and each
    configuration's (link Gb/s, TTFT, ideal, ratio). Later summaries win where two measured
    the same configuration."""
    out: dict[str, Any] = {}
    for summary in summaries:
        ideal = summary.get("ideal") or {}
        results = summary.get("results", {})
        single = results.get("single", {})
        overhead, token_bytes = ideal.get("overhead_ms"), ideal.get("kv_token_bytes")
        for name, entry in (ideal.get("configs") or {}).items():
            gbps = entry.get("link_gbps")
            if not gbps:
                continue
            for key, point in results.get(name, {}).items():
                m = re.fullmatch(r"c1_in(\d+)", key)
                if not m or "median_ttft_ms" not in point:
                    continue
                n = int(m[1])
                if prompt_lens and n not in prompt_lens:
                    continue
                base = single.get(key, {}).get("median_ttft_ms")
                length = out.setdefault(str(n), {"single_ttft_ms": base, "overhead_ms": overhead,
                                                 "kv_bytes": n * token_bytes if token_bytes
                                                 else None, "configs": {}})
                if base is not None:
                    length.update(single_ttft_ms=base, overhead_ms=overhead)
                row = {"series": series_of(name), "link": entry.get("link"),
                       "link_gbit_s": round(gbps * 8, 3), "ttft_ms": point["median_ttft_ms"]}
                if base is not None and overhead is not None and token_bytes:
                    ideal_ms = ideal_ttft_ms(base, overhead, n * token_bytes, gbps)
                    row.update(ideal_ttft_ms=round(ideal_ms, 2),
                               ratio=round(point["median_ttft_ms"] / ideal_ms, 3))
                length["configs"][name] = row
    return out


def markdown(table: dict[str, Any]) -> str:
    lines = ["| prompt | configuration | link | Gb/s | TTFT (ms) | ideal (ms) | x ideal | "
             "single (ms) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, length in sorted(table.items(), key=lambda kv: int(kv[0])):
        rows = sorted(length["configs"].items(), key=lambda kv: kv[1]["link_gbit_s"])
        single = length["single_ttft_ms"]
        for name, r in rows:
            ideal = f"{r['ideal_ttft_ms']:.1f}" if "ideal_ttft_ms" in r else "-"
            ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
            lines.append(f"| {n} | {name} | {r['link']} | {r['link_gbit_s']:g} | "
                         f"{r['ttft_ms']:.1f} | {ideal} | {ratio} | "
                         f"{'-' if single is None else f'{single:.1f}'} |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(table, key=int)
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        length = table[n]
        rates = [r["link_gbit_s"] for r in length["configs"].values()]
        series: dict[str, list[tuple[float, float]]] = {}
        for r in length["configs"].values():
            series.setdefault(r["series"], []).append((r["link_gbit_s"], r["ttft_ms"]))
        for label, points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        single, overhead, kv = length["single_ttft_ms"], length["overhead_ms"], length["kv_bytes"]
        if single is not None:
            ax.axhline(single, color="black", linestyle="--", label="single instance")
        if single is not None and overhead is not None and kv and rates:
            lo, hi = min(rates) / 1.5, max(rates) * 1.5
            xs = [lo * (hi / lo) ** (i / 63) for i in range(64)]
            ax.plot(xs, [ideal_ttft_ms(single, overhead, kv, x / 8) for x in xs], color="grey",
                    linestyle=":", label="ideal")
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Gb/s)")
        ax.set_ylabel("median TTFT (ms), concurrency 1")
        ax.set_title(f"{n}-token prompts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out / "link_rates.png", dpi=110)


def read_summaries(paths: list[Path]) -> list[dict[str, Any]]:
    found = []
    for path in paths:
        files = sorted(path.rglob("summary.json")) if path.is_dir() else [path]
        if not files:
            raise SystemExit(f"{path}: no summary.json there")
        found += [json.loads(f.read_text()) for f in files]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", type=Path, nargs="+",
                    help="ttft_bench.py output directories or summary.json files")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                    help="prompt lengths to draw (default: every one measured)")
    ap.add_argument("--out", type=Path, required=True,
                    help="where link_rates.json, link_rates.md and link_rates.png go")
    args = ap.parse_args()
    table = collect(read_summaries(args.paths), args.prompt_lens)
    if not table:
        raise SystemExit("no P/D configuration with a known link rate and a c=1 point (run "
                         "ttft_bench.py with 'single', and --link-probe or layerkv-tcp-<N>g)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link_rates.json").write_text(json.dumps(table, indent=1))
    (args.out / "link_rates.md").write_text(markdown(table))
    print(markdown(table))
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: link_rates.png not drawn (pip install matplotlib)")
        return
    plot(table, args.out)


if __name__ == "__main__":
    main()

"""Draw the README's headline plot from committed results: median TTFT at c=1 against prompt
length for the single instance, NixlConnector and LayerKV on 2 x H200 with CUDA graphs.

Reads the ``summary.json`` files of ``benchmarks/results/2026-11-26-x2-h200`` (single,
NixlConnector, LayerKV over CUDA IPC and over NIXL at 8K / 16K) and
``benchmarks/results/2026-11-24-x2-h200/c1`` (single and LayerKV at 4K / 8K / 16K). The left
panel shows TTFT, the right one TTFT divided by the same run's single instance. Needs
matplotlib.

Usage: python benchmarks/plot_headline.py [--out docs/images/ttft_vs_prompt.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from png import save_png  # benchmarks/png.py, beside this script

RESULTS = Path(__file__).resolve().parent / "results"

# (label, date, run folders under RESULTS, configuration name in their summary.json)
SERIES = [
    ("single instance", "2026-11-26", ["2026-11-26-x2-h200/single"], "single"),
    ("NixlConnector", "2026-11-26", ["2026-11-26-x2-h200/load"], "nixl"),
    ("LayerKV (CUDA IPC)", "2026-11-26", ["2026-11-26-x2-h200/load"], "layerkv"),
    ("LayerKV over NIXL", "2026-11-26", ["2026-11-26-x2-h200/nixl"], "layerkv-nixl"),
    ("single instance", "2026-11-24", ["2026-11-24-x2-h200/c1"], "single"),
    ("LayerKV (CUDA IPC)", "2026-11-24", ["2026-11-24-x2-h200/c1"], "layerkv"),
]
COLORS = {"single instance": "black", "NixlConnector": "tab:red",
          "LayerKV (CUDA IPC)": "tab:blue", "LayerKV over NIXL": "tab:green"}


def c1_medians(folders: list[str], config: str) -> dict[int, float]:
    """Prompt length -> median TTFT (ms) at c=1 of ``config`` in these runs."""
    out: dict[int, float] = {}
    for folder in folders:
        results = json.loads((RESULTS / folder / "summary.json").read_text())["results"]
        for key, point in results.get(config, {}).items():
            if key.startswith("c1_in") and "median_ttft_ms" in point:
                out[int(key[len("c1_in"):])] = point["median_ttft_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "docs/images/ttft_vs_prompt.png",
                    help="the PNG to write")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {(label, date): c1_medians(folders, config)
            for label, date, folders, config in SERIES}
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(9, 3.6))
    for (label, date), vals in data.items():
        xs = sorted(vals)
        single = data[("single instance", date)]
        style = dict(color=COLORS[label], marker="o", label=f"{label}, {date}",
                     linestyle="-" if date == "2026-11-26" else "--",
                     markerfacecolor=COLORS[label] if date == "2026-11-26" else "white")
        ax.plot(xs, [vals[x] for x in xs], **style)
        rel.plot(xs, [vals[x] / single[x] for x in xs], **style)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT (ms), c=1")
    ax.set_xticks([4096, 8192, 16000], ["4K", "8K", "16K"])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    rel.axhline(1.10, color="gray", linewidth=0.8, linestyle=":")
    rel.text(4300, 1.105, "target: 1.10 x single", color="gray", fontsize=8)
    rel.set_xlabel("prompt tokens")
    rel.set_ylabel("TTFT / single instance")
    rel.set_xticks([4096, 8192, 16000], ["4K", "8K", "16K"])
    rel.grid(True, alpha=0.3)
    rel.set_ylim(0.95, 1.25)
    fig.suptitle("2 x H200 (P on GPU 0, D on GPU 1), Llama-3.1-8B shape, vLLM 0.26, CUDA graphs",
                 fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

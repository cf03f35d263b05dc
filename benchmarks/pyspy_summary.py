"""Summarise py-spy raw profiles (``pyspy_probe.sh``'s output): per thread, and for LayerKV's own
code, the share of samples.

With the ``*.gil.txt`` files (py-spy ``--gil``: only samples whose thread held the GIL) this says
how much of the interpreter LayerKV's threads take from vLLM's engine thread, which in eager
mode launches every kernel from Python.

    python benchmarks/pyspy_summary.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def thread_of(frames: list[str]) -> str:
    """The function a thread runs: the frame after threading's bootstrap, else the root."""
    for i, frame in enumerate(frames):
        if frame.startswith("Thread.run "):
            return frames[i + 1].split(" (")[0] if i + 1 < len(frames) else frame
    return "main thread" if frames[0].startswith("<module>") else frames[0].split(" (")[0]


def summarise(path: Path) -> tuple[int, Counter[str], int]:
    """(samples, samples per thread, samples with a vllm_layerkv frame on the stack)."""
    total, layerkv = 0, 0
    threads: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[thread_of(frames)] += n
        if any("vllm_layerkv/" in f for f in frames):
            layerkv += n
    return total, threads, layerkv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args()
    for path in args.files:
        total, threads, layerkv = summarise(path)
        print(f"{path.name}: {total} samples, {layerkv} with LayerKV code on the stack"
              + (f" ({100 * layerkv / total:.1f} %)" if total else ""))
        for name, n in threads.most_common(8):
            print(f"  {100 * n / total:5.1f} %  {n:6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

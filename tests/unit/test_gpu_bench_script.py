"""benchmarks/gpu_bench.sh: a benchmark stopped by its own deadline (BENCH_TIMEOUT) still gets
its results packed, so a device call that runs long brings back what it measured. Runs the
script with stand-ins for nvidia-smi and python3 (a benchmark that never ends)."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # the benchmark: leaves a partial result, then runs until it is stopped
        "python3": 'echo partial > "$OUT/$RUN/summary.json"; exec sleep 600',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_a_benchmark_past_its_deadline_is_stopped_and_still_packed(tmp_path: Path,
                                                                     fake_bin: Path) -> None:
    out, bench = tmp_path / "out", tmp_path / "bench"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(out),
           "BENCH": str(bench), "RUN": "r1", "BENCH_TIMEOUT": "2", "MODEL": "/nonexistent"}
    started = time.monotonic()
    r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "single", "--", "--prompt-lens", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30, "the deadline did not stop the benchmark"
    assert "ttft_bench exit 124" in r.stdout, r.stdout + r.stderr
    assert (out / "summary_r1.json").read_text() == "partial\n"
    with tarfile.open(out / "bench.tar.gz") as tar:
        assert "./r1/summary.json" in tar.getnames()

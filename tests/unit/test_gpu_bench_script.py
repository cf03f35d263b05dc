"""benchmarks/gpu_bench.sh: a benchmark stopped by its own deadline (BENCH_TIMEOUT) still gets
its results packed, so a run that hits its time limit still keeps what it measured, and the
servers it left behind are stopped, but no one else's. Runs the script with stand-ins for
nvidia-smi and python3 (a benchmark that starts a "server" in a session of its own, as vLLM
servers are started, and never ends)."""

from __future__ import annotations

import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a process whose command line looks like a vLLM server's to pgrep -f
SERVER = "bash -c 'exec -a \"python3 -m vllm.entrypoints.cli.main serve stand-in\" sleep 600'"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone too
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # the benchmark: leaves a partial result and a server, then runs until it is stopped
        "python3": 'echo partial > "$OUT/$RUN/summary.json"\n'
                   f'setsid {SERVER} > /dev/null 2>&1 &\n'
                   'echo $! > "$OUT/server.pid"\n'
                   'exec sleep 600',
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
    # someone else's server on the same machine (another run, a test cluster)
    outsider = subprocess.Popen(["bash", "-c", SERVER.split(" ", 2)[2].strip("'")],
                                start_new_session=True)
    try:
        started = time.monotonic()
        r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "single", "--", "--prompt-lens",
                            "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 30, "the deadline did not stop the benchmark"
        deadline = time.monotonic() + 5
        ours = int((out / "server.pid").read_text())
        while alive(ours) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ours), "the benchmark's server was left running"
        assert alive(outsider.pid), "the clean-up stopped a server it had not started"
    finally:
        outsider.kill()
        outsider.wait()
        if (out / "server.pid").exists():  # the benchmark's, if the clean-up failed to stop it
            try:
                os.kill(int((out / "server.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "ttft_bench exit 124" in r.stdout, r.stdout + r.stderr
    assert (out / "summary_r1.json").read_text() == "partial\n"
    with tarfile.open(out / "bench.tar.gz") as tar:
        assert "./r1/summary.json" in tar.getnames()


def test_pyspy_probes_sample_their_point_and_do_not_outlive_the_benchmark(tmp_path: Path) -> None:
    """PYSPY + PYSPY_POINTS: a probe records over the point that ran (its output comes back in
    the run's folder); a probe whose point never ran is stopped when the benchmark ends instead
    of waiting its 10 minutes for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # a stand-in D whose command line pyspy_probe.sh finds, with an engine child to sample
        "consumer": 'sleep 600 & wait',
        # the benchmark: names one point in bench.log while its D runs, then ends
        "python3": f'setsid bash {bin_dir}/consumer kv_consumer > /dev/null 2>&1 &\n'
                   'd=$!; sleep 1\n'
                   'echo "vllm bench serve --result-filename pt1.json" >> "$OUT/$RUN/bench.log"\n'
                   'sleep 3; kill -- -$d; echo done > "$OUT/$RUN/summary.json"',
        # py-spy: notes what it sampled, then runs until its process is gone
        "py-spy": 'while [ $# -gt 0 ]; do case $1 in -o) o=$2; shift;; --pid) p=$2; shift;; '
                  'esac; shift; done\n'
                  'echo "sampled $p" > "$o"\n'
                  'while kill -0 "$p" 2>/dev/null; do sleep 0.2; done',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "BENCH": str(tmp_path / "bench"), "RUN": "r1", "MODEL": "/nonexistent",
           "PYSPY": str(bin_dir / "py-spy"), "PYSPY_POINTS": "pt1 pt2", "PYSPY_SECONDS": "30"}
    started = time.monotonic()
    r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "layerkv", "--"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 40, f"gpu_bench.sh waited {took:.0f} s for a probe whose point never ran"
    sampled = list((out / "r1" / "pyspy_pt1").glob("pyspy_consumer_*.gil.txt"))
    assert sampled and sampled[0].read_text().startswith("sampled "), r.stdout
    assert not list((out / "r1").glob("pyspy_pt2/*.txt"))
    left = subprocess.run(["pgrep", "-f", f"pyspy_probe.sh {bin_dir}"], capture_output=True,
                          text=True).stdout.split()
    assert not left, f"probes left running: {left}"

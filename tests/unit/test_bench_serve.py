"""benchmarks/bench_serve.py: points run one after another in one worker, each point's output
in its own file, and a failing, malformed, hung or dying point reported without losing the
next one. The worker runs a stand-in for vLLM's benchmark module (same two functions,
``add_cli_args`` and ``main``); tests/e2e/test_benchmark_smoke.py runs the real one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmark_scripts import load

bench_serve = load("bench_serve")

STAND_IN = '''
import json, os, sys, time

def add_cli_args(parser):
    parser.add_argument("--mode", default="ok", choices=["ok", "fail", "hang", "die"])
    parser.add_argument("--result", required=True)

def main(args):
    print("printed to stdout")
    print("printed to stderr", file=sys.stderr)
    os.write(1, b"written to fd 1\\n")  # as a C extension or a subprocess would
    if args.mode == "fail":
        raise ValueError("no server at that URL")
    if args.mode == "hang":
        time.sleep(600)
    if args.mode == "die":
        os._exit(3)
    with open(args.result, "w") as f:
        json.dump({"pid": os.getpid()}, f)
'''


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "stand_in_bench.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = bench_serve.BenchServe(tmp_path / "worker.log", module="stand_in_bench")
    yield r
    r.close()


def point(runner, tmp_path: Path, name: str, *argv: str, timeout: float = 120) -> int:
    """Runs one point; returns the pid of the worker that wrote its result."""
    result = tmp_path / f"{name}.json"
    runner.run(["--result", str(result), *argv], tmp_path / f"{name}.out", timeout=timeout)
    return json.loads(result.read_text())["pid"]


def test_points_share_one_worker_and_keep_their_own_output(runner, tmp_path: Path) -> None:
    first = point(runner, tmp_path, "a")
    assert point(runner, tmp_path, "b") == first  # imported once
    for name in ("a", "b"):
        out = (tmp_path / f"{name}.out").read_text()
        for line in ("printed to stdout", "printed to stderr", "written to fd 1"):
            assert out.count(line) == 1, out
    # nothing of a point leaks into the worker's log
    assert "printed" not in (tmp_path / "worker.log").read_text()


def test_a_failing_point_says_why_and_the_next_one_runs(runner, tmp_path: Path) -> None:
    first = point(runner, tmp_path, "a")
    with pytest.raises(RuntimeError, match="ValueError: no server at that URL") as e:
        point(runner, tmp_path, "bad", "--mode", "fail")
    assert "Traceback" in str(e.value)  # the end of the point's output comes with it
    with pytest.raises(RuntimeError, match="exited with 2"):  # argparse: not a valid line
        point(runner, tmp_path, "bad", "--mode", "nonsense")
    assert point(runner, tmp_path, "c") == first


def test_a_hung_point_is_killed_at_its_deadline(runner, tmp_path: Path) -> None:
    first = point(runner, tmp_path, "a")
    with pytest.raises(RuntimeError, match="did not finish in 2 s"):
        point(runner, tmp_path, "hang", "--mode", "hang", timeout=2)
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    assert point(runner, tmp_path, "c") != first  # a fresh worker


def test_a_dying_worker_is_reported_and_replaced(runner, tmp_path: Path) -> None:
    first = point(runner, tmp_path, "a")
    with pytest.raises(RuntimeError, match="the benchmark worker exited"):
        point(runner, tmp_path, "die", "--mode", "die")
    assert point(runner, tmp_path, "c") != first


def test_close_ends_the_worker(runner, tmp_path: Path) -> None:
    pid = point(runner, tmp_path, "a")
    runner.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

"""`vllm bench serve`, run point after point by one worker process that imports vLLM once.

Every `vllm bench serve` command imports vLLM before it sends a request: about 11 s on a
2-core CPU machine and 16 s or more on the H200 hosts of benchmarks/results/, against 1-4 s of
requests for a c=1 point. ttft_bench.py runs a dozen points per sweep, so a process per point
spent minutes of each sweep importing (benchmarks/results/2026-11-24-h200-bench-worker/).

``BenchServe`` starts one worker (this file, ``--worker``) that imports vLLM's benchmark module
(``vllm.benchmarks.serve``, the code behind the command) while the first configuration's servers
start, and then hands it one command line per point. The worker builds the command's parser
(``add_cli_args``), parses the line and calls the command's ``main``, exactly what the
`vllm bench serve` subcommand does, with the point's output (stdout and stderr, at the file
descriptor level, so vLLM's log lines and tqdm too) in the point's own file. A point that
overruns its deadline kills the worker; the next point starts a fresh one.

Protocol on the worker's stdin / stdout: one JSON line per point, ``{"argv": [...], "output":
path}``, answered by one JSON line, ``{"ok": bool, "error": str}``. Anything the worker prints
between points goes to its log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

BENCH_MODULE = "vllm.benchmarks.serve"


class BenchServe:
    """The parent's end: starts the worker, sends it points, enforces their deadlines."""

    def __init__(self, log_path: Path, module: str = BENCH_MODULE) -> None:
        self._log_path = log_path
        self._module = module
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None

    def start(self) -> None:
        """Start the worker if none is running; returns at once (the import runs meanwhile)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._log is None:  # one handle for every worker this runner starts
            self._log = open(self._log_path, "a")
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", self._module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True)

    @property
    def pid(self) -> int | None:
        """The running worker's PID (the benchmark client), or None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def run(self, argv: list[str], output: Path, timeout: float) -> None:
        """Run one `vllm bench serve` command line (without ``vllm bench serve``); raises
        RuntimeError, with the end of ``output``, if it fails or overruns ``timeout`` seconds
        (which count from here, so a worker still importing uses up part of them)."""
        self.start()
        assert self._proc is not None and self._proc.stdin and self._proc.stdout
        job = json.dumps({"argv": argv, "output": str(output)})
        try:
            self._proc.stdin.write(job + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died; reported below from its missing reply
        deadline = time.monotonic() + timeout
        reply_fd = self._proc.stdout.fileno()
        while not select.select([reply_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                self._kill()
                raise RuntimeError(f"did not finish in {timeout:.0f} s (worker killed)"
                                   f"{_tail(output)}")
        line = self._proc.stdout.readline()
        if not line:
            self._kill()
            raise RuntimeError(f"the benchmark worker exited (log: {self._log_path})"
                               f"{_tail(output)}{_tail(self._log_path)}")
        reply: dict[str, Any] = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"{reply['error']}{_tail(output)}")

    def close(self) -> None:
        """Let the worker finish (end of its input), or kill it after 10 s."""
        if self._proc is not None:
            if self._proc.stdin:
                try:
                    self._proc.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # its asyncio threads, tokenizers...
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return f"\n--- end of {path} ---\n{text[-chars:]}" if text else ""


def _run_point(module: Any, argv: list[str]) -> tuple[bool, str]:
    """What `vllm bench serve ARGV` does once vLLM is imported: parse, configure logging,
    main."""
    # The subcommand's parser is vLLM's FlexibleArgumentParser, which the benchmark module
    # imports for its own signatures (0.26 and 0.32 alike); a stand-in may use argparse's.
    parser_class = getattr(module, "FlexibleArgumentParser", argparse.ArgumentParser)
    parser = parser_class(prog="vllm bench serve")
    module.add_cli_args(parser)
    try:
        args = parser.parse_args(argv)
        vllm_logger = sys.modules.get("vllm.logger")
        configure = getattr(vllm_logger, "configure_logging_from_args", None)  # vLLM >= 0.27
        if configure is not None:
            configure(args)
        module.main(args)
        return True, ""
    except SystemExit as e:  # argparse on a bad line
        return False, f"vllm bench serve exited with {e.code}"
    except Exception as e:  # the benchmark's own failure, traceback in the point's output
        traceback.print_exc()
        return False, f"vllm bench serve failed: {type(e).__name__}: {e}"


def worker(module_name: str) -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints outside a point go to the worker's log, not into the replies
    module = importlib.import_module(module_name)
    for line in sys.stdin:
        job = json.loads(line)
        with open(job["output"], "w") as output:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            try:
                ok, error = _run_point(module, job["argv"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        replies.write(json.dumps({"ok": ok, "error": error}) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        sys.exit("usage: bench_serve.py --worker MODULE (started by BenchServe, not by hand)")
    sys.exit(worker(sys.argv[2]))

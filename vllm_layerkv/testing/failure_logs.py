"""What the servers of a failed end-to-end test logged, for the test report.

A CPU P/D test that fails in CI often fails far from its cause: a request that D gave up on
after ``kv_wait_timeout_s`` shows up as an HTTP 500 from the proxy, and the reason is in P's or
D's log, which CI does not keep. :func:`failure_report` picks from each log of a cluster's
folder the lines that say what went wrong (warnings, errors, tracebacks) and the last lines
written, so the report alone shows where to look."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable
from pathlib import Path

NOTABLE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|Error:|Exception")
"""A log line worth showing: vLLM's and LayerKV's warnings and errors, and Python tracebacks."""
START_UP_NOISE = re.compile(
    r"ulimit|Enforce eager|Inductor compilation|Triton is not installed|Reset SSM cache|"
    r"Model Runner V2|LD_PRELOAD|KVConnectorBase_V1|NUMA binding|FutureWarning|"
    r"DeprecationWarning|reduce_op")
"""Warnings every CPU server prints while it starts: they say nothing about a failure."""


def notable_lines(lines: Iterable[str], max_notable: int = 30, last: int = 10) -> list[str]:
    """The last ``max_notable`` notable lines (start-up noise left out) and the last ``last``
    lines of all, each line once, in log order."""
    notable: collections.deque[tuple[int, str]] = collections.deque(maxlen=max_notable)
    tail: collections.deque[tuple[int, str]] = collections.deque(maxlen=last)
    for n, line in enumerate(lines):
        line = line.rstrip("\n")
        if NOTABLE.search(line) and not START_UP_NOISE.search(line):
            notable.append((n, line))
        tail.append((n, line))
    picked = dict(notable)
    picked.update(tail)
    return [picked[n] for n in sorted(picked)]


def failure_report(folders: Iterable[Path], max_notable: int = 30, last: int = 10) -> str:
    """For every ``*.log`` in ``folders`` (one level deep), its :func:`notable_lines` under a
    header naming the file; "" when there is no log."""
    parts = []
    for folder in dict.fromkeys(folders):
        for log in sorted(folder.glob("*.log")):
            try:
                with log.open("r", errors="replace") as f:
                    lines = notable_lines(f, max_notable, last)
            except OSError as e:
                lines = [f"(unreadable: {e})"]
            parts.append(f"--- {log}\n" + "\n".join(lines))
    return "\n".join(parts)

"""CPU time of the benchmark's processes, thread by thread, over one benchmark point (Linux /proc).

Why: under load on 2 x H200 (benchmarks/results/2026-11-24-x2-h200), D's eager decode steps
took 15 ms in some stretches and 30-35 ms in others. That happened in NixlConnector's and
LayerKV's runs alike, while P was busy on its own GPU, and not when P was nearly idle. Eager,
D's step is bound by its engine thread launching kernels, so anything on the host that takes
CPU from that thread shows in TPOT. This records, for each group of processes (P, D, the proxy,
the benchmark client), the CPU time its threads used during a point and the threads that used
the most. It also records how many of the host's cores were busy.

A thread that ends during the point is not counted (it is gone from /proc at the second
snapshot); vLLM's and the connector's long-lived threads are all there.

Used by ``ttft_bench.py`` for every load point (``cpu`` in ``summary.json``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass
class Snapshot:
    """CPU seconds per thread of each group, and the host's busy / total time, at ``at``."""

    threads: dict[str, dict[int, tuple[int, str, float]]]  # group -> tid -> (pid, name, s)
    host_busy_s: float
    host_total_s: float
    host_cpus: int
    at: float = field(default_factory=time.monotonic)


def thread_times(pids: list[int]) -> dict[int, tuple[int, str, float]]:
    """tid -> (pid, thread name, CPU seconds so far) for every thread of these processes.
    Processes or threads that end while being read are skipped."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            # the name sits in parentheses and may hold spaces or parentheses itself
            name = stat[stat.find("(") + 1:stat.rfind(")")]
            fields = stat[stat.rfind(")") + 2:].split()
            # fields[0] is the state (field 3 of stat(5)): utime and stime are fields 14, 15
            out[int(tid)] = (pid, name, (int(fields[11]) + int(fields[12])) / TICKS_PER_S)
    return out


def host_times() -> tuple[float, float, int]:
    """The host's busy and total CPU seconds so far, summed over its CPUs, and how many CPUs
    /proc/stat lists (in a container: the host's, which its totals cover)."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    values = [int(v) for v in lines[0].split()[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = values[3] + values[4]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    return (total - idle) / TICKS_PER_S, total / TICKS_PER_S, cpus


def take(groups: dict[str, list[int]]) -> Snapshot:
    """A snapshot of every thread of each group's processes (group name -> PIDs)."""
    busy, total, cpus = host_times()
    return Snapshot({g: thread_times(pids) for g, pids in groups.items()}, busy, total, cpus)


def usage(before: Snapshot, after: Snapshot, top: int = 5) -> dict[str, Any]:
    """Per group, between two snapshots: CPU seconds, the cores that makes over the wall time,
    how many threads used at least 5 % of a core, and the ``top`` threads by CPU. The host:
    how many cores were busy, of how many."""
    wall = max(after.at - before.at, 1e-9)
    out: dict[str, Any] = {"wall_s": round(wall, 2)}
    for group, threads in after.threads.items():
        earlier = before.threads.get(group, {})
        used = []
        for tid, (pid, name, seconds) in threads.items():
            prev = earlier.get(tid)
            # a tid reused by a new thread: count it from 0 (its name or process differs)
            start = prev[2] if prev and prev[:2] == (pid, name) else 0.0
            used.append((seconds - start, pid, tid, name))
        used.sort(reverse=True)
        cpu_s = sum(u[0] for u in used)
        out[group] = {
            "cpu_s": round(cpu_s, 2),
            "cores": round(cpu_s / wall, 2),
            "busy_threads": sum(1 for u in used if u[0] / wall >= 0.05),
            "threads": len(used),
            "top": [{"name": name, "pid": pid, "tid": tid, "cores": round(s / wall, 2)}
                    for s, pid, tid, name in used[:top]],
        }
    span = after.host_total_s - before.host_total_s
    cpus = after.host_cpus
    out["host"] = {"busy_cores": round((after.host_busy_s - before.host_busy_s) / span * cpus, 2)
                   if span > 0 else None, "cpus": cpus}
    return out


def one_line(cpu: dict[str, Any]) -> str:
    """The log line's part: cores per group with its busiest thread, and the host's."""
    parts = []
    for group, u in cpu.items():
        if group in ("wall_s", "host") or not isinstance(u, dict):
            continue
        first = u["top"][0] if u["top"] else None
        busiest = f", busiest thread {first['name']} {first['cores']}" if first else ""
        parts.append(f"{group} {u['cores']} cores ({u['busy_threads']} threads >= 5 %{busiest})")
    host = cpu.get("host", {})
    parts.append(f"host {host.get('busy_cores')} of {host.get('cpus')} busy")
    return "; ".join(parts)

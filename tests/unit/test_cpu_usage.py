"""benchmarks/cpu_usage.py: CPU time by process group and thread over a point, from /proc,
measured on this test's own threads (one of them burns CPU between the two snapshots)."""

from __future__ import annotations

import os
import threading
import time

from benchmark_scripts import load

cpu_usage = load("cpu_usage")


def burn(stop: threading.Event, burned: threading.Event, tid: list[int]) -> None:
    """Burn CPU until ``stop``; set ``burned`` once this thread has used 0.2 s of CPU time
    (CPU, not wall time: on a busy 2-core host the thread may wait for a core)."""
    tid.append(threading.get_native_id())
    while not stop.is_set():
        if time.thread_time() >= 0.2:
            burned.set()


def test_the_thread_that_burns_cpu_is_the_busiest_of_its_group() -> None:
    groups = {"tests": [os.getpid()], "gone": [2**22 + 7]}
    before = cpu_usage.take(groups)
    stop, burned, tid = threading.Event(), threading.Event(), []
    t = threading.Thread(target=burn, args=(stop, burned, tid))
    t.start()
    try:
        assert burned.wait(60), "the burner never got 0.2 s of CPU"
        after = cpu_usage.take(groups)  # while it still runs: a thread that ended is gone
    finally:
        stop.set()
        t.join()
    u = cpu_usage.usage(before, after)
    group = u["tests"]
    busiest = group["top"][0]
    assert busiest["tid"] == tid[0] and busiest["pid"] == os.getpid(), group
    assert busiest["cores"] * u["wall_s"] >= 0.15, group  # 0.2 s of CPU, ticks rounded
    assert group["cpu_s"] >= 0.15 and group["threads"] >= 2 and group["busy_threads"] >= 1
    # a process that does not exist is an empty group, not an error
    assert u["gone"] == {"cpu_s": 0, "cores": 0.0, "busy_threads": 0, "threads": 0, "top": []}
    assert u["host"]["cpus"] >= 1 and u["host"]["busy_cores"] > 0


def test_a_reused_thread_id_counts_from_zero() -> None:
    snap = cpu_usage.Snapshot
    before = snap({"d": {11: (1, "old", 50.0)}}, 0.0, 10.0, 2, at=0.0)
    after = snap({"d": {11: (1, "new", 2.0)}}, 1.0, 12.0, 2, at=2.0)
    u = cpu_usage.usage(before, after)
    assert u["d"]["cpu_s"] == 2.0 and u["d"]["cores"] == 1.0
    assert u["host"] == {"busy_cores": 1.0, "cpus": 2}


def test_the_log_line_names_each_group_s_busiest_thread() -> None:
    snap = cpu_usage.Snapshot
    before = snap({"decode": {1: (1, "VLLM::EngineCor", 0.0), 2: (1, "python3", 0.0)},
                   "client": {}}, 0.0, 0.0, 4, at=0.0)
    after = snap({"decode": {1: (1, "VLLM::EngineCor", 9.5), 2: (1, "python3", 0.2)},
                  "client": {}}, 12.0, 40.0, 4, at=10.0)
    line = cpu_usage.one_line(cpu_usage.usage(before, after))
    assert line == ("decode 0.97 cores (1 threads >= 5 %, busiest thread VLLM::EngineCor "
                    "0.95); client 0.0 cores (0 threads >= 5 %); host 1.2 of 4 busy")

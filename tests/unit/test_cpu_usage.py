"""benchmarks/cpu_usage.py: CPU time by process group and thread over a point, from /proc,
measured on this test's own threads (one of them burns CPU between the two snapshots)."""

from __future__ import annotations

import os
import threading
import time

from benchmark_scripts import load

cpu_usage = load("cpu_usage")


def burn(seconds: float, tid: list[int]) -> None:
    tid.append(threading.get_native_id())
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # CPU time, not wall time: enough even on a busy host
        pass


def test_the_thread_that_burns_cpu_is_the_busiest_of_its_group() -> None:
    tid: list[int] = []
    before = cpu_usage.take({"tests": [os.getpid()], "gone": [2**22 + 7]})
    t = threading.Thread(target=burn, args=(0.3, tid))
    t.start()
    t.join()
    # the burner has ended: take the second snapshot while a second one still runs
    tid2: list[int] = []
    t2 = threading.Thread(target=burn, args=(0.3, tid2))
    t2.start()
    while not tid2:
        time.sleep(0.01)
    after = cpu_usage.take({"tests": [os.getpid()], "gone": [2**22 + 7]})
    t2.join()
    u = cpu_usage.usage(before, after)
    group = u["tests"]
    assert group["top"][0]["tid"] == tid2[0], group  # running at the second snapshot
    assert group["top"][0]["pid"] == os.getpid()
    assert group["cpu_s"] >= group["top"][0]["cores"] * u["wall_s"] > 0
    assert group["threads"] >= 2 and group["busy_threads"] >= 1
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

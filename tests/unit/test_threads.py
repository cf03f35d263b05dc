"""threads.py: LayerKV's threads carry their names into the kernel (``lkv-...``), where
``top -H`` and benchmarks/cpu_usage.py read them; Python keeps the full name. And the prefill
worker's group events are blocking, so the sender sleeps instead of spinning while a layer
group computes. A component's stop waits for the threads it ended (``ThreadGroup``)."""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import pytest

from vllm_layerkv.common.threads import (
    ThreadGroup,
    kernel_name,
    set_switch_interval,
    start_thread,
)
from vllm_layerkv.scheduler.registrar import RegistrationServer
from vllm_layerkv.worker import prefill as prefill_worker

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def kernel_names() -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}


def test_kernel_name_shortens_the_prefix_and_keeps_15_bytes() -> None:
    assert kernel_name("layerkv-sender") == "lkv-sender"
    assert kernel_name("layerkv-registrar-push") == "lkv-registrar-p"
    assert kernel_name("layerkv-acks-127.0.0.1:5555") == "lkv-acks-127.0."
    assert kernel_name("other") == "other"
    assert len(kernel_name("layerkv-" + "x" * 40).encode()) == 15


@linux_only
def test_a_started_thread_names_itself_in_the_kernel() -> None:
    seen: dict[str, object] = {}

    def body(a: int, b: str) -> None:
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        seen.update(comm=comm.read_text().strip(), args=(a, b),
                    python=threading.current_thread().name)

    t = start_thread(body, "layerkv-registrar-push", 7, "x")
    t.join(5)
    assert t.daemon
    assert seen == {"comm": "lkv-registrar-p", "args": (7, "x"),
                    "python": "layerkv-registrar-push"}


@linux_only
def test_a_real_component_shows_its_threads_by_name() -> None:
    server = RegistrationServer("127.0.0.1", 0, on_register=lambda reg: None,
                                on_cancel=lambda c: None)
    try:
        deadline = time.monotonic() + 5  # each thread names itself once it runs
        while not {"lkv-registrar", "lkv-registrar-p"} <= kernel_names():
            assert time.monotonic() < deadline, kernel_names()
            time.sleep(0.01)
    finally:
        server.close()


def test_group_events_are_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict] = []
    fake_cuda = types.SimpleNamespace(Event=lambda **kw: made.append(kw) or object())
    import torch

    monkeypatch.setattr(torch, "cuda", fake_cuda)
    assert prefill_worker._new_event("cuda") is not None
    assert made == [{"blocking": True}]
    assert prefill_worker._new_event("cpu") is None
    assert len(made) == 1


def test_traced_steps_get_timing_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a trace, the group events also time the group (``group_ready``), still blocking."""
    made: list[dict] = []
    fake_cuda = types.SimpleNamespace(Event=lambda **kw: made.append(kw) or object())
    import torch

    monkeypatch.setattr(torch, "cuda", fake_cuda)
    assert prefill_worker._new_event("cuda", timing=True) is not None
    assert made == [{"blocking": True, "enable_timing": True}]


def test_the_switch_interval_is_set_for_the_process_and_zero_leaves_it() -> None:
    """gil_switch_interval_ms: a worker sets Python's GIL switch interval for its process; 0
    (the default) leaves it."""
    before = sys.getswitchinterval()
    try:
        assert set_switch_interval(0) is None
        assert sys.getswitchinterval() == before
        assert set_switch_interval(0.5) == pytest.approx(before * 1e3)
        assert sys.getswitchinterval() == pytest.approx(0.5e-3)
        seen: list[float] = []
        start_thread(lambda: seen.append(sys.getswitchinterval()), "layerkv-probe").join(5)
        assert seen == [pytest.approx(0.5e-3)]  # the whole process, every thread
    finally:
        sys.setswitchinterval(before)


def test_a_group_waits_for_its_threads_and_names_those_still_running() -> None:
    group = ThreadGroup()
    quick, slow = threading.Event(), threading.Event()
    group.start(quick.wait, "layerkv-quick")
    group.start(slow.wait, "layerkv-slow")
    assert len(group) == 2
    quick.set()
    t0 = time.monotonic()
    assert group.join(0.3) == ["layerkv-slow"]
    assert 0.25 < time.monotonic() - t0 < 5  # the timeout is for the whole group
    assert len(group) == 1
    slow.set()
    assert group.join(5) == []
    assert len(group) == 0


def test_a_group_member_that_stops_the_group_does_not_wait_for_itself() -> None:
    group = ThreadGroup()
    seen: list[list[str]] = []
    group.start(lambda: seen.append(group.join(5)), "layerkv-self")
    assert group.join(5) == []
    assert seen == [[]]


def test_join_waits_for_the_thread_to_end_not_only_for_its_target_to_return() -> None:
    """A thread still runs after its target returns (``threading`` cleans up); a stop that
    returned before that let a process exit with the thread alive, which aborted it."""
    group = ThreadGroup()
    for i in range(50):
        group.start(lambda: None, f"layerkv-brief-{i}")
    assert group.join(5) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("layerkv-brief-")]


def test_ended_threads_are_dropped_when_the_next_starts() -> None:
    group = ThreadGroup()
    for i in range(20):
        group.start(lambda: None, f"layerkv-ended-{i}").join(5)
    group.start(lambda: None, "layerkv-last").join(5)
    assert len(group._threads) == 1

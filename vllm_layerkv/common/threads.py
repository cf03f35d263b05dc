"""LayerKV's background threads, named for the operating system as well as for Python.

Python's thread name lives in Python only. ``top -H``, ``ps -L``, py-spy's native view and
``benchmarks/cpu_usage.py`` read the kernel's name, which a thread otherwise inherits from
its process: every thread of a vLLM engine reads "VLLM::EngineCor". Under load on 2 x H200 a
thread of P's engine other than its main one used 0.75 of a core, and nothing could tell
whether it was LayerKV's sender or vLLM's own (benchmarks/results/2026-11-26-x2-h200). So
each LayerKV thread also names itself in the kernel, as ``lkv-...`` cut to the 15 bytes the
kernel keeps.

Components that stop their threads wait for them through a ``ThreadGroup``. The process's
GIL switch interval is set here too (``set_switch_interval``): how long a LayerKV
thread that wants the GIL back waits while another thread runs Python."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any, Callable

_PR_SET_NAME = 15  # linux/prctl.h
_KERNEL_NAME_BYTES = 15  # TASK_COMM_LEN less its NUL

STOP_WAIT_S = 5.0
"""How long a stop waits for the threads it ended (they return within milliseconds once their
sockets close); one still inside a long copy after that is left to finish."""

_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to call: threads keep the process's name
        _libc = None


def kernel_name(name: str) -> str:
    """The name the kernel shows for a thread called ``name`` in Python."""
    if name.startswith("layerkv-"):
        name = "lkv-" + name[len("layerkv-"):]
    return name.encode()[:_KERNEL_NAME_BYTES].decode(errors="ignore")


def name_current_thread(name: str) -> None:
    """Give the calling thread ``kernel_name(name)`` in the kernel. Best effort: a platform
    without prctl keeps the inherited name."""
    if _libc is None:
        return
    try:
        _libc.prctl(_PR_SET_NAME, kernel_name(name).encode(), 0, 0, 0)
    except (AttributeError, OSError):
        pass


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread running ``target(*args)``, called ``name`` in Python and
    ``kernel_name(name)`` in the kernel."""

    def run() -> None:
        name_current_thread(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class ThreadGroup:
    """The threads one component starts, so that stopping it can wait for them to end.

    A stop that only wakes its threads (closes their sockets) returns while they are still
    unwinding, and a process that exits then has daemon threads running into the interpreter's
    shutdown. Python ends such a thread where it next takes the GIL, and one that does so
    inside native code aborts the whole process ("terminate called without an active
    exception"): a script that stopped a TCP receiver and exited at once died that way about
    every other run. ``join`` closes that window."""

    def __init__(self) -> None:
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
        """``start_thread(target, name, *args)``, remembered until it has ended. (Not until
        ``target`` returns: the thread still runs Python after that, and ``join`` must wait for
        that too. Ended threads are dropped here.)"""
        thread = start_thread(target, name, *args)
        with self._lock:
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
        return thread

    def join(self, timeout: float = STOP_WAIT_S) -> list[str]:
        """Wait up to ``timeout`` seconds in all for the group's threads (the calling thread
        excepted) to return; the names of those still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]

    def __len__(self) -> int:
        """Threads of the group still running."""
        with self._lock:
            return sum(t.is_alive() for t in self._threads)


def set_switch_interval(ms: float) -> float | None:
    """Set the process's GIL switch interval (``sys.setswitchinterval``) to ``ms``; 0 leaves
    it. Returns the interval it replaced, in ms, or None when it left it.

    A thread that waits for the GIL while another runs Python gets it only once that one has
    run for the interval (Python's default is 5 ms). A ring piece through host memory takes
    the sender's GIL after each of its blocking steps (the grant, the copy, the post, every
    completion poll, the report), so beside an engine thread that runs Python each step can
    cost up to the interval: one thread spinning in Python beside the sender cut LayerKV's
    link probe of NIXL over UCX tcp from 5 GB/s to 0.4 GB/s on 2 x H200. A shorter interval
    hands the GIL over sooner, at the cost of more switches between every thread of the
    process."""
    if ms <= 0:
        return None
    previous = sys.getswitchinterval() * 1e3
    sys.setswitchinterval(ms / 1e3)
    return previous

"""Session-wide pytest hooks."""

from __future__ import annotations

import os
import sys

import pytest

_exit_status = 0


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """NIXL 1.5.1 crashes the interpreter at teardown (SIGSEGV in its native destructors)
    once any agent was created in the process, even after the agent was deleted: a Python
    process that only creates an agent and returns exits 139. The conformance tests create
    agents in-process, so once pytest has reported everything, leave without running the
    native destructors, keeping pytest's own exit status."""
    if "nixl._api" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)

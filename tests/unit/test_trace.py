"""The trace file keeps the order events happened in, whichever thread flushes them."""

from __future__ import annotations

import builtins
import json
import threading
from pathlib import Path

import pytest

from vllm_layerkv.common import trace
from vllm_layerkv.common.trace import Tracer


def read_events(path: Path) -> list[str]:
    return [json.loads(line)["ev"] for line in path.read_text().splitlines()]


def test_off_writes_nothing(tmp_path: Path) -> None:
    tracer = Tracer("", "p", 0)
    tracer.event("group_send_start", step=1, group=0)
    tracer.flush()
    assert list(tmp_path.iterdir()) == []


def test_events_carry_their_fields_and_land_in_the_role_and_rank_file(tmp_path: Path) -> None:
    tracer = Tracer(str(tmp_path / "sub" / "trace"), "d", 1)
    tracer.event("kv_arrived", transfer_id="t-1", blocks=3)
    tracer.flush()
    tracer.flush()  # nothing pending: nothing written twice
    (line,) = (tmp_path / "sub" / "trace.d.1").read_text().splitlines()
    event = json.loads(line)
    assert event["ev"] == "kv_arrived" and event["transfer_id"] == "t-1" and event["blocks"] == 3
    assert isinstance(event["t"], float)


def test_a_flush_that_took_older_events_writes_them_before_a_later_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender thread and the scheduler step both flush. Stall the first flush between
    taking its events and opening the file; a second flush from another thread must not
    write its newer events ahead of them."""
    tracer = Tracer(str(tmp_path / "trace"), "p", 0)
    first_open_reached, release_first_open = threading.Event(), threading.Event()
    real_open = builtins.open
    opens = 0

    def stalling_open(*args, **kwargs):
        nonlocal opens
        opens += 1
        if opens == 1:
            first_open_reached.set()
            assert release_first_open.wait(10)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(trace, "open", stalling_open, raising=False)

    tracer.event("older")
    first = threading.Thread(target=tracer.flush)
    first.start()
    assert first_open_reached.wait(10)
    tracer.event("newer")
    second = threading.Thread(target=tracer.flush)
    second.start()
    second.join(0.3)  # without ordering, the second flush writes "newer" here
    release_first_open.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert read_events(tmp_path / "trace.p.0") == ["older", "newer"]

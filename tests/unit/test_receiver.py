"""receiver.py: a transfer whose request continues from P's first token is reported to vLLM
only once both its KV and the token are here, whichever comes last, and never early. (The
rest of RecvTable runs under every transport in test_transport_conformance.py.)"""

from __future__ import annotations

import time

from kv_sides import compat

from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.tasks import RecvTask
from vllm_layerkv.worker.receiver import RecvTable


def table() -> RecvTable:
    return RecvTable(compat(), tp_rank=0, tp_size=1, unknown_wait_s=0.5, stats=WorkerStats(),
                     early_lead_s=0.05)


def test_kv_first_then_token() -> None:
    t = table()
    t.expect(RecvTask("r1", "t1", [1, 2], wants_first_token=True))
    ack = t.on_done("t1", src_rank=0, src_tp=1, frames=2, nbytes=10)
    assert ack is not None and ack.ok  # P may free its blocks: the KV is all here
    assert t.drain() == (set(), set())  # but vLLM must not schedule it without the token
    assert t.pending() == 1
    t.token_arrived("t1")
    assert t.drain() == ({"r1"}, set())
    assert t.pending() == 0


def test_token_first_then_kv() -> None:
    t = table()
    t.expect(RecvTask("r1", "t1", [1], wants_first_token=True))
    t.token_arrived("t1")
    assert t.drain() == (set(), set())
    t.on_done("t1", src_rank=0, src_tp=1, frames=1, nbytes=10)
    assert t.drain() == ({"r1"}, set())


def test_never_reported_early() -> None:
    t = table()
    t.expect(RecvTask("r1", "t1", [1], wants_first_token=True))
    t.expect(RecvTask("r2", "t2", [2]))
    t.on_nearly_done("t1", src_rank=0, eta_s=0.0)
    t.on_nearly_done("t2", src_rank=0, eta_s=0.0)
    assert t.take_early(time.monotonic() + 1) == {"r2"}


def test_a_transfer_waiting_for_its_token_can_still_fail() -> None:
    """D's scheduler gives up (kv_wait_timeout_s) when the token never comes: the close fails
    the request instead of leaving it parked."""
    t = table()
    t.expect(RecvTask("r1", "t1", [1], wants_first_token=True))
    t.on_done("t1", src_rank=0, src_tp=1, frames=1, nbytes=10)
    t.close("t1", failed=True, reason="no first token")
    assert t.drain() == (set(), {"r1"})
    t.token_arrived("t1")  # too late: nothing more is reported
    assert t.drain() == (set(), set())


def test_without_first_token_the_kv_alone_completes_it() -> None:
    t = table()
    t.expect(RecvTask("r1", "t1", [1]))
    t.on_done("t1", src_rank=0, src_tp=1, frames=1, nbytes=10)
    assert t.drain() == ({"r1"}, set())

"""``counters.py``: a worker's counts are taken once, summed the way vLLM sums the workers'
stats, and handed to vLLM as ``LayerKVStats`` with the same numbers."""

from __future__ import annotations

from vllm_layerkv.counters import Counts, WorkerStats, empty_counts
from vllm_layerkv.stats import LayerKVStats


def test_take_returns_the_counts_once_and_none_when_nothing_was_counted() -> None:
    stats = WorkerStats()
    assert stats.take() is None
    stats.record_group(1000, 0.5)
    stats.record_group(24, 0.25)
    stats.record_sent(0.125)
    counts = stats.take()
    assert counts is not None
    assert counts.data["bytes_sent"] == 1024 and counts.data["groups_sent"] == 2
    assert counts.data["send_seconds"] == [0.5, 0.25]
    assert counts.data["transfers_sent"] == 1 and counts.data["exposed_seconds"] == [0.125]
    assert stats.take() is None  # taken: counting starts again


def test_counts_and_vllm_stats_aggregate_alike() -> None:
    a, b = WorkerStats(), WorkerStats()
    a.record_received(100, 1.0)
    b.record_received(50, 2.0)
    b.record_failed()
    first, second = a.take(), b.take()
    assert first is not None and second is not None
    summed = Counts(dict(first.data, recv_seconds=list(first.data["recv_seconds"])))
    summed.aggregate(second)
    assert summed.data["bytes_received"] == 150 and summed.data["transfers_received"] == 2
    assert summed.data["transfers_failed"] == 1 and summed.data["recv_seconds"] == [1.0, 2.0]
    vllm_side = LayerKVStats(data=first.data).aggregate(LayerKVStats(data=second.data))
    assert vllm_side.data == summed.data
    assert LayerKVStats(data=empty_counts()).is_empty()

"""Transfer counters without vLLM: the keys of LayerKV's stats and ``WorkerStats``, the
thread-safe accumulator a worker's threads (the sender, the receiver, the per-layer hook) fill.
``stats.py`` hands the counts to vLLM; keeping them apart lets the threads load without vLLM."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

LIST_KEYS = ("send_seconds", "exposed_seconds", "recv_seconds")
SUM_KEYS = ("bytes_sent", "bytes_received", "groups_sent", "transfers_sent",
            "transfers_received", "transfers_failed", "remote_prefill_fallbacks")


def empty_counts() -> dict[str, Any]:
    # vLLM's KVConnectorStats.data: counters (int) and samples (list[float]) under one dict
    data: dict[str, Any] = {k: 0 for k in SUM_KEYS}
    data.update({k: [] for k in LIST_KEYS})
    return data


def nothing_counted(data: dict[str, Any]) -> bool:
    """No counter moved (the samples go with the counters they belong to)."""
    return not any(data.get(k) for k in SUM_KEYS)


def add_counts(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other``'s counters and samples to ``into`` (vLLM sums the workers' stats so)."""
    for k in SUM_KEYS:
        into[k] = into.get(k, 0) + other.get(k, 0)
    for k in LIST_KEYS:
        into.setdefault(k, []).extend(other.get(k, []))
    return into


@dataclass
class Counts:
    """What a worker counted since the last ``take`` (``data``: as vLLM's stats carry it)."""

    data: dict[str, Any]

    def aggregate(self, other: Counts) -> Counts:
        add_counts(self.data, other.data)
        return self


class WorkerStats:
    """Thread-safe accumulator inside one worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_counts()

    def record_group(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._data["bytes_sent"] += nbytes
            self._data["groups_sent"] += 1
            self._data["send_seconds"].append(seconds)

    def record_sent(self, exposed_seconds: float | None) -> None:
        with self._lock:
            self._data["transfers_sent"] += 1
            if exposed_seconds is not None:
                self._data["exposed_seconds"].append(exposed_seconds)

    def record_received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._data["bytes_received"] += nbytes
            self._data["transfers_received"] += 1
            self._data["recv_seconds"].append(seconds)

    def record_failed(self) -> None:
        with self._lock:
            self._data["transfers_failed"] += 1

    def take(self) -> Counts | None:
        """The counts since the last call, or None if nothing was counted."""
        with self._lock:
            data, self._data = self._data, empty_counts()
        return None if nothing_counted(data) else Counts(data)

"""The rate at which this prefill worker's sends actually move, as the sender measures it.

The group planner (``grouping.py``) needs to know how long a step's KV takes on the link: on a
link slower than the prefill (TCP between hosts, NIXL over UCX tcp) a group's bytes arrive long
after its layers are computed, so large groups leave the link idle at the start of a step and
expose a whole group's transfer at its end. No setting can know the link; the sender times
every group it writes (from the moment the group is ready on the device to its last byte
handed over), which includes everything the path does per byte: device-to-host copies, the
socket or engine, D's grants. Groups too small to say anything about the rate are ignored.

Ring writes (``host_bounce``, staged head slices) stay in flight across groups and land in the
order they were posted, so the sender times those by the link's busy time instead: each write
adds the time from its start, or from the landing before it if that came later, to its own
landing. Overlapping writes often land in bursts (several within a millisecond, after a long
wait): the first of a burst is charged the time all of them moved in. So writes are added up
into one sample until they cover ``WINDOW_S`` of busy time and no other write is in flight
(every byte of that time has landed), or, when writes never stop, ``MAX_WINDOW_S``.
"""

from __future__ import annotations

MIN_SAMPLE_BYTES = 1 << 20
"""Groups smaller than this are dominated by per-write costs, not the link's rate."""
SMOOTHING = 0.5
"""Weight of the newest sample: the rate follows a changed link within a few groups."""
WINDOW_S = 0.02
"""Busy time that landed writes add up to before they make one sample..."""
MAX_WINDOW_S = 0.2
"""...or this much while other writes are still in flight (a sample may then count a burst's
time without all of its bytes; the next one has them)."""


class LinkRate:
    """Bytes per second of recent group sends (None until the first sizeable one). Written by
    the sender thread, read by the worker thread when it plans a step: a float assignment,
    atomic under the GIL."""

    def __init__(self) -> None:
        self._bytes_per_s: float | None = None
        self._window_bytes = 0
        self._window_s = 0.0

    @property
    def bytes_per_s(self) -> float | None:
        return self._bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """One group of ``nbytes`` took ``seconds`` from ready to sent."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self._bytes_per_s
        self._bytes_per_s = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old

    def observe_write(self, nbytes: int, busy_s: float, others_in_flight: bool) -> None:
        """One write of ``nbytes`` landed, having had the link to itself for ``busy_s``
        (from its start or the previous landing, whichever was later)."""
        self._window_bytes += nbytes
        self._window_s += max(0.0, busy_s)
        if ((self._window_s >= WINDOW_S and not others_in_flight)
                or self._window_s >= MAX_WINDOW_S):
            self.observe(self._window_bytes, self._window_s)
            self._window_bytes, self._window_s = 0, 0.0

    def seconds_for(self, nbytes: int) -> float:
        """Expected time on the link for ``nbytes``; 0.0 while the rate is unknown."""
        rate = self._bytes_per_s
        return nbytes / rate if rate else 0.0

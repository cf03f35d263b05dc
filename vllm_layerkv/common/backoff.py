"""Exponential backoff: a wait that starts short and doubles up to a ceiling.

Used where a thread polls for something that usually comes soon but may take long: the first
waits keep latency low, the doubling keeps a long wait from spinning a core.
"""

from __future__ import annotations


class Backoff:
    """``next()`` returns the current wait, then doubles it (up to ``maximum``); ``reset()``
    starts over from ``first``."""

    def __init__(self, first: float, maximum: float):
        if not 0 < first <= maximum:
            raise ValueError(f"backoff needs 0 < first <= maximum, got {first} and {maximum}")
        self.first = first
        self.maximum = maximum
        self.current = first

    def next(self) -> float:
        wait = self.current
        self.current = min(2 * self.current, self.maximum)
        return wait

    def reset(self) -> None:
        self.current = self.first

"""Link emulation for benchmarks: a token bucket that paces the TCP transport's payload sends to
a set rate (setting ``tcp_pacing_gbps``), so that two instances on one host, whose loopback
moves several GB/s, stand in for two hosts joined by a slower link in a link-rate sweep.

The bucket holds at most ``burst`` bytes of credit and refills at ``rate`` bytes per second. A
send takes credit for its bytes; once the credit is spent the sender sleeps until the refill
has paid the debt back. Sleeping past the deadline is no error: the refill counts the time
actually elapsed, so the next send waits less, and the average rate holds. Payloads go out in
pieces of at most ``burst`` bytes, so the rate also holds over every window of a few
milliseconds, not only over a whole transfer. One bucket paces every connection of a worker
(the worker's link), from however many threads send on them.

Only the payload of byte frames (``BlockData``) is paced: control messages are a few hundred
bytes each, and direct planes (CUDA IPC, NIXL, Mooncake) move memory outside the socket.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from vllm_layerkv.wire import framing

BURST_S = 0.001
"""Credit the bucket holds, in seconds of the rate: the longest burst at the socket's own
speed."""
MIN_BURST_BYTES = 64 << 10
MAX_BURST_BYTES = 16 << 20


class TokenBucket:
    """Paces bytes to ``bytes_per_s`` with bursts of at most ``burst_bytes``. Thread-safe."""

    def __init__(self, bytes_per_s: float, burst_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_per_s <= 0 or burst_bytes <= 0:
            raise ValueError(f"a token bucket needs a positive rate and burst, not "
                             f"{bytes_per_s} B/s and {burst_bytes} B")
        self.rate = float(bytes_per_s)
        self.burst = int(burst_bytes)
        self._clock = clock
        self._sleep = sleep
        self._credit = float(burst_bytes)
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Take credit for ``nbytes``; sleep until the bucket has refilled what this took
        beyond the credit it held (every earlier taker's debt included)."""
        with self._lock:
            now = self._clock()
            self._credit = min(float(self.burst), self._credit + (now - self._last) * self.rate)
            self._last = now
            self._credit -= nbytes
            wait = -self._credit / self.rate
        if wait > 0:
            self._sleep(wait)

    def sendall(self, sock: socket.socket, data: memoryview | bytes) -> None:
        """``sock.sendall(data)`` at the bucket's rate, in pieces of at most ``burst`` bytes."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.burst):
            piece = view[start:start + self.burst]
            self.take(len(piece))
            framing.send_all(sock, piece)


def pacer_for(gbps: float) -> TokenBucket | None:
    """The bucket for ``tcp_pacing_gbps`` (gigabits per second), or None for 0 (no pacing)."""
    if gbps <= 0:
        return None
    rate = gbps * 1e9 / 8
    burst = int(min(MAX_BURST_BYTES, max(MIN_BURST_BYTES, rate * BURST_S)))
    return TokenBucket(rate, burst)

"""Optional JSON-lines trace of transfer events (``trace_path`` setting).

Off by default. When on, the per-layer hook only appends a tuple to a list; the file is written
by whoever calls ``flush`` (the sender thread or the end of the step), never by the hook.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class Tracer:
    def __init__(self, path: str, role: str, rank: int):
        self.enabled = bool(path)
        self._path = f"{path}.{role}.{rank}" if path else ""
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        # Held from taking the pending events until they are written: two threads flush (the
        # sender after each item, the scheduler after each step), and without it the one that
        # took the older events could write them after the other's newer ones. ``event`` never
        # takes it, so the per-layer hook never waits on file I/O.
        self._write_lock = threading.Lock()
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)

    def event(self, ev: str, **fields: Any) -> None:
        if not self.enabled:
            return
        fields["ev"] = ev
        fields["t"] = time.monotonic()
        with self._lock:
            self._pending.append(fields)

    def flush(self) -> None:
        if not self.enabled:
            return
        with self._write_lock:
            with self._lock:
                pending, self._pending = self._pending, []
            if pending:
                with open(self._path, "a") as f:
                    for e in pending:
                        f.write(json.dumps(e) + "\n")

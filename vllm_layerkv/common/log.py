"""Logger names: each module takes ``logger = init_logger(__name__)``, as vLLM's modules do.

vLLM attaches its handler and level to its ``vllm`` logger only, so a plugin's records show in
vLLM's log output only from a logger below it: ``vllm_layerkv.worker.sender`` logs as
``vllm.layerkv.worker.sender``. This module does not import vLLM's own ``init_logger``: the
proxy, which never imports vLLM, uses it too (under ``vllm-layerkv proxy`` the root logger's
handler prints the same records).
"""

from __future__ import annotations

import logging
import time

PACKAGE = "vllm_layerkv"
LOGGER_ROOT = "vllm.layerkv"


def logger_name(module: str) -> str:
    """``vllm_layerkv.x.y`` -> ``vllm.layerkv.x.y``; any other name is kept."""
    if module == PACKAGE or module.startswith(PACKAGE + "."):
        return LOGGER_ROOT + module[len(PACKAGE):]
    return module


def init_logger(module: str) -> logging.Logger:
    return logging.getLogger(logger_name(module))


class RateLimitedWarning:
    """A warning that repeats per request (a misconfigured router sends every request the
    same way): logged at most once per ``interval_s``; the next line counts what was held."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last = float("-inf")
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        if held:
            msg += f" ({held} more like it in the last {self._interval_s:.0f} s)"
        self._logger.warning(msg, *args)

"""The event loop the proxy runs on: uvloop where it is installed (vLLM installs it, and its
own API server runs on it), else asyncio's. Each request passes through the proxy twice (the
client's request out to P and D, the answer back), so the loop's cost per socket operation is
on every TTFT; ``benchmarks/proxy_hop.py`` measures it."""

from __future__ import annotations

import asyncio
from typing import Callable

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""``--event-loop`` choices: ``auto`` is uvloop when it can be imported, else asyncio."""


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The loop ``choice`` (one of EVENT_LOOPS) resolves to: its name and a factory (None:
    asyncio's default). A ValueError says what to change when uvloop is asked for and
    missing."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed here; install it "
                             "(pip install uvloop) or use --event-loop asyncio") from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop

"""proxy/event_loop.py: which loop ``--event-loop`` gives, and a clear error when uvloop is asked
for and missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from vllm_layerkv.proxy.event_loop import EVENT_LOOPS, loop_factory


def test_auto_is_uvloop_where_installed_and_asyncio_is_asyncios_own() -> None:
    pytest.importorskip("uvloop")
    name, factory = loop_factory("auto")
    assert name == "uvloop" and factory is not None
    loop = factory()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
    assert loop_factory("uvloop")[0] == "uvloop"
    assert loop_factory("asyncio") == ("asyncio", None)


def test_without_uvloop_auto_falls_back_and_uvloop_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") == ("asyncio", None)
    with pytest.raises(ValueError, match="pip install uvloop.*--event-loop asyncio"):
        loop_factory("uvloop")


def test_an_unknown_choice_names_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        loop_factory("trio")
    assert EVENT_LOOPS == ("auto", "uvloop", "asyncio")


def test_the_proxy_serves_on_the_loop_it_resolves_to() -> None:
    """run_proxy runs its server in an asyncio.Runner built from the factory."""
    pytest.importorskip("uvloop")
    _, factory = loop_factory("auto")

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(which()).startswith("uvloop")

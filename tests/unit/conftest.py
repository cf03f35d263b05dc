"""Fixtures shared by the transport tests (kv_sides.py has the helpers they use)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kv_sides import DSide, PSide, start_d, start_p


@pytest.fixture
def transport() -> str:
    """The transport under test; test_transport_conformance.py parametrizes it."""
    return "tcp"


@pytest.fixture
def d_side(transport: str) -> Iterator[Callable[..., DSide]]:
    """Makes decode ends (``start_d`` arguments); shuts them down after the test."""
    made: list[DSide] = []

    def make(**kw) -> DSide:
        side = start_d(transport=transport, **kw)
        made.append(side)
        return side

    yield make
    for side in made:
        side.transport.shutdown()


@pytest.fixture
def p_side(transport: str) -> Iterator[Callable[..., PSide]]:
    """Makes prefill ends (``start_p`` arguments); shuts their senders down after the test."""
    made: list[PSide] = []

    def make(*args, **kw) -> PSide:
        side = start_p(transport, *args, **kw)
        made.append(side)
        return side

    yield make
    for side in made:
        side.sender.shutdown()

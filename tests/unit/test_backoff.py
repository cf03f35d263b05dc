"""common/backoff.py: the one exponential backoff the worker, P's scheduler and NIXL polls use."""

from __future__ import annotations

import pytest

from vllm_layerkv.common.backoff import Backoff


def test_doubles_up_to_the_ceiling_and_resets() -> None:
    b = Backoff(0.01, 0.05)
    assert [b.next() for _ in range(5)] == [0.01, 0.02, 0.04, 0.05, 0.05]
    b.reset()
    assert b.current == 0.01


def test_equal_first_and_maximum_never_grows() -> None:
    b = Backoff(0.002, 0.002)
    assert [b.next() for _ in range(3)] == [0.002] * 3


@pytest.mark.parametrize("first,maximum", [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_bad_bounds_say_what_is_wrong(first: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="0 < first <= maximum"):
        Backoff(first, maximum)

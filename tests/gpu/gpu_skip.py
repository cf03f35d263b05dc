"""Skipping a GPU case that needs what this machine lacks (an engine, a second GPU), the same
way under pytest and when a test file runs as a script on the GPU image, whose runner catches
``Skipped`` (the image may have pytest installed too, and the script's runner does not know
pytest's skip)."""

from __future__ import annotations

from typing import NoReturn


class Skipped(Exception):
    """A case the script run skips."""


def skip(why: str, caller: str) -> NoReturn:
    """``caller``: the test module's ``__name__`` ("__main__" when it runs as a script)."""
    if caller != "__main__":
        try:
            import pytest
        except ImportError:
            pass
        else:
            pytest.skip(why)
    raise Skipped(why)

"""Skipping a GPU case that needs what this machine lacks (an engine, a second GPU), the same
way under pytest and when a test file runs as a script on the GPU image, whose runner
(``run_as_script``) catches ``Skipped`` (the image may have pytest installed too, and the
script's runner does not know pytest's skip)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


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


def run_as_script(namespace: dict[str, Any],
                  arguments: dict[str, list[tuple[Any, ...]]] | None = None) -> int:
    """Run every ``test_*`` function of a test module's ``namespace`` (its ``globals()``), each
    once, or once per argument tuple in ``arguments[name]`` (a parametrized test), printing
    PASSED / SKIPPED / FAILED per test; returns the number that failed."""
    failed = 0
    tests = [(n, fn) for n, fn in list(namespace.items())
             if n.startswith("test_") and callable(fn)]
    for name, fn in tests:
        test: Callable[..., Any] = fn
        try:
            for args in (arguments or {}).get(name, [()]):
                test(*args)
            print("PASSED", name, flush=True)
        except Skipped as e:
            print("SKIPPED", name, e, flush=True)
        except Exception as e:  # noqa: BLE001 - report every case
            failed += 1
            print("FAILED", name, repr(e)[:2000], flush=True)
    return failed

"""No module of the repository uses a name it never defines. Such a name fails only when its
line runs: in the GPU tests and GPU benchmark scripts, which CI never runs, it surfaces on the
GPU machine after a whole run (a pair test once read two locals a refactor had removed)."""

from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("vllm_layerkv", "tests", "benchmarks", "scripts")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message: messages.Message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename: str, msg: str, lineno: int, offset: int,  # noqa: N802
                    text: str) -> None:
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename: str, msg: str) -> None:  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def python_files() -> list[Path]:
    return sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_no_module_uses_an_undefined_name() -> None:
    files = python_files()
    assert len(files) > 100  # the whole tree, not an empty glob
    report = _Collect()
    for path in files:
        api.checkPath(str(path), report)
    assert report.found == []


def test_the_check_sees_an_undefined_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return gpu_p\n")
    report = _Collect()
    api.checkPath(str(bad), report)
    assert report.found and "undefined name 'gpu_p'" in report.found[0]

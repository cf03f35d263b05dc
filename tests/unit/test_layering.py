"""The package's import graph, read with ``ast``, keeps the layering docs/architecture.md states:
no cycles; the scheduler side never imports the worker side; transports import neither; the
proxy imports neither the connector nor vLLM; ``common/`` depends on nothing else. And the
subpackages on disk are the ones the architecture's "Package layout" table describes."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_layerkv"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, module: str, modules: Iterable[str] = ()) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports count too).
    ``from pkg import name`` imports ``pkg.name`` when that is one of ``modules``, else ``pkg``."""
    known = set(modules)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def package_graph() -> Graph:
    """module -> the package's own modules it imports, and external packages by their
    top-level name ('vllm', 'torch', ...)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Graph = {}
    for module, path in files.items():
        edges = {name if name in files else name.split(".")[0]
                 for name in imported_modules(path, module, files)
                 if name in files or not name.startswith("vllm_layerkv")}
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt in graph and nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: Graph, start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def in_part(module: str, part: str) -> bool:
    name = f"vllm_layerkv.{part}"
    return module == name or module.startswith(name + ".")


def violations(graph: Graph, part: str, forbidden: Iterable[str]) -> list[str]:
    """Modules of ``part`` that reach a forbidden part or external package, with the path
    through the graph (imports of imports count: a layer is only as clean as what it loads)."""
    found = []
    for module in sorted(m for m in graph if in_part(m, part)):
        for target in sorted(reachable(graph, module)):
            for bad in forbidden:  # a part of the package, or an external package ('vllm')
                if target == bad or in_part(target, bad):
                    found.append(f"{module} -> {target}")
    return found


GRAPH = package_graph()


def test_no_import_cycles() -> None:
    assert find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(find_cycle(GRAPH) or [])}"


@pytest.mark.parametrize("part,forbidden", [
    ("scheduler", ["worker", "transport", "proxy"]),
    ("worker", ["scheduler", "proxy"]),
    ("transport", ["scheduler", "worker", "connector"]),
    ("kv", ["scheduler", "worker", "transport", "connector"]),
    ("wire", ["scheduler", "worker", "transport", "kv", "connector", "vllm", "torch"]),
    ("common", ["scheduler", "worker", "transport", "kv", "wire", "proxy", "connector", "compat",
                "config", "metadata", "stats", "vllm", "torch"]),
    ("proxy", ["connector", "scheduler", "worker", "transport", "kv", "wire", "compat",
               "metadata", "stats", "vllm", "torch"]),
    ("cli", ["connector", "scheduler", "worker", "transport", "vllm", "torch"]),
])
def test_layer_imports_only_what_it_may(part: str, forbidden: list[str]) -> None:
    bad = violations(GRAPH, part, forbidden)
    assert not bad, f"vllm_layerkv/{part} must not import {forbidden}:\n" + "\n".join(bad)


def test_the_worker_threads_load_without_vllm() -> None:
    """The sender and receiver threads, their work orders and counters load without vLLM
    (which takes seconds of CPU to import): the link probe and the multi-process transfer tests
    run them in processes of their own. Checked at run time, in a fresh interpreter: lazy
    imports inside functions that only vLLM's side calls do not count."""
    modules = ["vllm_layerkv.worker.sender", "vllm_layerkv.worker.receiver",
               "vllm_layerkv.tasks", "vllm_layerkv.counters", "vllm_layerkv.transport"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]


def test_every_part_is_checked() -> None:
    """A new subpackage gets a row in the layering rules above (and in the docs)."""
    checked = {"scheduler", "transport", "kv", "wire", "common", "proxy", "worker", "testing"}
    assert set(subpackages_on_disk()) <= checked, set(subpackages_on_disk()) - checked


def subpackages_on_disk() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def subpackages_in_architecture() -> list[str]:
    text = ARCHITECTURE.read_text()
    section = text.split("## Package layout", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"^\| `vllm_layerkv/(\w+)/`", section, re.M)))


def test_architecture_layout_matches_the_subpackages() -> None:
    assert subpackages_in_architecture() == subpackages_on_disk()


def test_architecture_names_only_modules_that_exist() -> None:
    section = ARCHITECTURE.read_text().split("## Package layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for row in re.findall(r"^\| `vllm_layerkv/([\w/.]+)` \|(.*)$", section, re.M):
        path, rest = row
        base = PACKAGE / path
        if path.endswith(".py"):
            if not base.exists():
                missing.append(path)
            continue
        for name in re.findall(r"`(\w+\.py)`", rest):
            if not (base / name).exists():
                missing.append(path + name)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


# ------------------------------------------------------------ the checker itself can fail
def test_find_cycle_reports_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_violations_follow_imports_of_imports() -> None:
    graph: Graph = {"vllm_layerkv.scheduler.x": {"vllm_layerkv.metadata"},
                    "vllm_layerkv.metadata": {"vllm_layerkv.worker.y"},
                    "vllm_layerkv.worker.y": set()}
    assert violations(graph, "scheduler", ["worker"]) == [
        "vllm_layerkv.scheduler.x -> vllm_layerkv.worker.y"]


def test_relative_and_from_imports_are_read(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from . import sibling\nfrom ..kv import tp\nimport vllm.config\n"
                 "def lazy():\n    from vllm_layerkv.worker import sender\n")
    names = imported_modules(f, "vllm_layerkv.scheduler.m",
                             ["vllm_layerkv.scheduler.sibling", "vllm_layerkv.kv.tp"])
    assert names == {"vllm_layerkv.scheduler.sibling", "vllm_layerkv.kv.tp", "vllm.config",
                     "vllm_layerkv.worker"}

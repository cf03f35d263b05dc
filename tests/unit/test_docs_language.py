"""The project's prose describes the product and its results, not how it was developed.

README.md, CHANGELOG.md, docs/**/*.md, the results' README files, and the comments and
docstrings of every tracked .py and .sh file are checked against FORBIDDEN: words that belong
to a development diary (numbered work periods, borrowed machines and their limits, tracker
numbers). A result names its date, its hardware and its exact command instead. Legitimate uses
of the same words (HTTP clients, pytest scopes, process groups, Mooncake's segment name) are
matched by ALLOWED and pass.

Also here: the README stays short, and the tracked tree stays small (raw benchmark outputs are
not tracked; see .gitignore).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (pattern, what it names): each match on a line is a finding
FORBIDDEN: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bsessions?\b", re.I), "a development session"),
    (re.compile(r"\blent\b", re.I), "a lent machine"),
    (re.compile(r"\bdevice[- ]calls?\b", re.I), "a device call"),
    (re.compile(r"\bdevice time\b", re.I), "device time"),
    (re.compile(r"\bcarry[- ]limits?\b", re.I), "a carry limit"),
    (re.compile(r"\bissues?\s*#?\d+", re.I), "an issue number"),
    (re.compile(r"\b(the|this|that) issue\b|\bissue's\b|\b(GPU|NIXL|TP|transport) issue\b"
                r"|\bissue\s+[\"“(]", re.I), "the issue"),
    (re.compile(r"shared/gpu\b|\.gpu/(bin|q\d|p\d|tools)"), "the GPU staging bundle"),
]

# Legitimate uses, removed from a line before FORBIDDEN is applied. Keep this list short and
# explicit: each entry names one kind of use.
ALLOWED: list[re.Pattern[str]] = [re.compile(p, re.I) for p in (
    r"\w*ClientSession\w*",                           # aiohttp
    r"\b(client|HTTP|aiohttp|pooled) sessions?\b",    # an HTTP client
    r"\w_session\b",                                  # code: app_session, self._session
    r"\.\_?session\b",                                # attribute access: self._session
    r"\bsession\s*[:=]",                              # a field or keyword argument (protocol.py)
    r"\[[\"']session[\"']\]",                         # app["session"]
    r"scope\s*=\s*[\"']session[\"']",                 # pytest fixture scope
    r"\bpytest[._]session\w*|\bpytest\.Session\b",    # pytest hooks and types
    r"\bsession[- ](wide|scoped?|fixtures?|cluster)\b",  # pytest's session scope
    r"\bonce per session\b",                          # a session-scoped fixture
    r"\bstart_new_session\b|\bsetsid\b",              # process sessions
    r"\b(new|own|process) sessions?\b",               # process sessions
    r"\bsessions? of (its|their) own\b",              # process sessions
    r"\bsession name\b|\bsegment session\b",          # Mooncake's segment name
    r"``?MooncakeExport``?\s+session\b",              # Mooncake's segment name
)]


def findings(lines: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """(line number, what was found, the line) for every forbidden word in these lines."""
    out = []
    for number, line in lines:
        text = line
        for allowed in ALLOWED:
            text = allowed.sub(" ", text)
        for pattern, what in FORBIDDEN:
            if pattern.search(text):
                out.append((number, what, line.strip()))
                break
    return out


def python_prose(source: str) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python source, as (line number, text)."""
    lines: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                lines.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return lines
    src = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        body = node.body
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc = body[0]
            end = doc.end_lineno or doc.lineno
            lines += [(n, src[n - 1]) for n in range(doc.lineno, end + 1)]
    return sorted(lines)


_SHELL_COMMENT = re.compile(r"(?:^|\s)#(?!!)(.*)$")


def shell_prose(source: str) -> list[tuple[int, str]]:
    """The comments of a shell script (a ``#`` at a word's start, outside quotes on its line)."""
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        if number == 1 and line.startswith("#!"):
            continue
        quote = None
        for i, ch in enumerate(line):
            if quote:
                if ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1].isspace()):
                lines.append((number, line[i:]))
                break
    return lines


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def is_prose_file(path: str) -> bool:
    return (path in ("README.md", "CHANGELOG.md")
            or (path.startswith("docs/") and path.endswith(".md"))
            or (path.startswith("benchmarks/results/") and path.endswith("/README.md")))


def scan(paths: list[str]) -> list[str]:
    """``file:line: what: text`` for every finding in these files."""
    report = []
    for path in paths:
        text = (ROOT / path).read_text(errors="replace")
        if path.endswith(".md"):
            lines = list(enumerate(text.splitlines(), 1))
        elif path.endswith(".py"):
            lines = python_prose(text)
        elif path.endswith(".sh"):
            lines = shell_prose(text)
        else:
            continue
        report += [f"{path}:{n}: {what}: {line}" for n, what, line in findings(lines)]
    return report


# --- the checker itself -------------------------------------------------------------------

@pytest.mark.parametrize("line", [
    "Measured in session 18 on the lent GPUs.",
    "This session added early release.",
    "The next session should rerun the load point.",
    "(seventeenth session) D decoded slower.",
    "Only one-GPU kinds were lent.",
    "Each device call carries 64 MiB.",
    "within a device call's carry limit",
    "600 s of device time were spent",
    "the TPOT half of issue 3's load target",
    "Against the target (issue \"NIXL and Mooncake transports\")",
    "measured on the issue's layout",
    "c=1 target (GPU issue)",
    "staged from ../shared/gpu/build_bundle.sh",
])
def test_the_checker_flags_history(line: str) -> None:
    assert findings([(1, line)]), line


@pytest.mark.parametrize("line", [
    "self.session = aiohttp.ClientSession(timeout=timeout)",
    "async with self.session.get(url) as resp:",
    'app["session"] = aiohttp.ClientSession()',
    "One pooled session for everything.",
    "n fake P + m fake D + the proxy + a client session.",
    '@pytest.fixture(scope="session")',
    "def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:",
    "vLLM servers are started once per session.",
    "the real servers of the session cluster",
    "proc = subprocess.Popen(cmd, start_new_session=True)",
    "# own session => own process group: stop() signals the API server together",
    "they run in sessions of their own, so a killed benchmark leaves them up",
    "D offers its session name and the layer addresses",
    "``MooncakeExport`` session) and P moves blocks",
    "    session: str",
    'MooncakeExport(session="10.0.0.2:15223", protocol="tcp")',
    "The sender thread issues its device copies from Python.",
])
def test_the_checker_allows_legitimate_uses(line: str) -> None:
    assert not findings([(1, line)]), line


def test_comments_and_docstrings_are_read_code_is_not() -> None:
    source = '''"""Module docstring: measured in session 18."""
x = "a string in code: the next session"  # a comment: lent GPUs
def f():
    """Docstring of f.

    Second line: issue 3.
    """
    return "device call"
'''
    got = [(n, what) for n, what, _ in findings(python_prose(source))]
    assert got == [(1, "a development session"), (2, "a lent machine"), (6, "an issue number")]
    sh = '#!/bin/bash\n# on a lent machine\necho "# not a comment: lent" # device calls\nx=${#y}\n'
    assert [n for n, _, _ in findings(shell_prose(sh))] == [2, 3]


def test_scan_reports_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("fine\nmeasured in the tenth session\n")
    monkeypatch.setitem(scan.__globals__, "ROOT", tmp_path)
    assert scan(["docs/x.md"]) == [
        "docs/x.md:2: a development session: measured in the tenth session"]


# --- the project --------------------------------------------------------------------------

AREAS = {
    "docs": lambda p: is_prose_file(p),
    "benchmarks": lambda p: p.startswith("benchmarks/") and p.endswith((".py", ".sh")),
    "scripts": lambda p: p.startswith("scripts/") and p.endswith((".py", ".sh")),
    "tests": lambda p: p.startswith("tests/") and p.endswith((".py", ".sh")),
    "vllm_layerkv": lambda p: p.startswith("vllm_layerkv/") and p.endswith((".py", ".sh")),
    "other": lambda p: (p.endswith((".py", ".sh")) and not p.startswith(
        ("benchmarks/", "scripts/", "tests/", "vllm_layerkv/"))),
}


@pytest.mark.parametrize("area", list(AREAS))
def test_no_development_history(area: str) -> None:
    files = [p for p in tracked_files() if AREAS[area](p)]
    if area in ("docs", "benchmarks", "tests", "vllm_layerkv"):
        assert files, f"no tracked files found for {area}"
    report = scan(files)
    assert not report, ("development history in the project's prose (describe the product; "
                        "a result names its date, hardware and command):\n" + "\n".join(report))


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 160, f"README.md has {lines} lines (at most 160: details go to docs/)"


def test_tracked_tree_is_small() -> None:
    total = sum((ROOT / p).stat().st_size for p in tracked_files())
    assert total < 5_000_000, (
        f"tracked files take {total / 1e6:.2f} MB (under 5 MB: benchmark results keep "
        "README, summary.json, tables and plots; raw outputs are not tracked)")

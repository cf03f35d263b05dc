"""Every option a user can give the project's commands is documented: the proxy's in
docs/proxy.md, the benchmark scripts' options and environment settings in
docs/benchmark-scripts.md (the connector's settings: test_config.py). Options are read from
the sources, so a new one without its line in the docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS_DOC = ROOT / "docs" / "benchmark-scripts.md"


def cli_options(source: Path) -> set[str]:
    """The --options a script's argparse parser declares."""
    return set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source.read_text()))


def env_settings(source: Path) -> set[str]:
    """The environment variables a shell script reads with a default (``${NAME:-...}``)."""
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):-", source.read_text()))


def undocumented(names: set[str], doc: Path) -> list[str]:
    text = doc.read_text()
    return sorted(n for n in names if f"`{n}`" not in text and f"`{n} " not in text)


def test_the_readers_find_options_and_settings() -> None:
    # the regular expressions above still match how the sources declare things
    assert {"--model", "--configs", "--load", "--out"} <= cli_options(BENCHMARKS / "ttft_bench.py")
    assert {"BENCH", "RUN", "PYSPY"} <= env_settings(BENCHMARKS / "gpu_bench.sh")
    assert {"--prefill", "--decode", "--log-level"} <= cli_options(ROOT / "vllm_layerkv" / "cli.py")


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_option_is_documented(script: str) -> None:
    text = SCRIPTS_DOC.read_text()
    assert f"`{script}`" in text or f"`{script} " in text, f"{script} has no section"
    missing = undocumented(cli_options(BENCHMARKS / script), SCRIPTS_DOC)
    assert not missing, f"{script} options missing from {SCRIPTS_DOC.name}: {missing}"


# the benchmark wrappers
SHELL_SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in BENCHMARKS.glob("*.sh"))


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_every_benchmark_setting_is_documented(script: str) -> None:
    missing = undocumented(env_settings(ROOT / script), SCRIPTS_DOC)
    assert not missing, f"{script} settings missing from {SCRIPTS_DOC.name}: {missing}"


def test_every_proxy_option_is_documented() -> None:
    missing = undocumented(cli_options(ROOT / "vllm_layerkv" / "cli.py"),
                           ROOT / "docs" / "proxy.md")
    assert not missing, f"proxy options missing from docs/proxy.md: {missing}"

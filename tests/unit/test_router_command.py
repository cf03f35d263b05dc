"""vllm_layerkv/testing/router.py: where the ``vllm-router`` command is found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_layerkv.testing import router
from vllm_layerkv.testing.servers import ServerError


def fake_binary(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "vllm-router"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_interpreter_s_own_router_comes_first_then_path(tmp_path, monkeypatch) -> None:
    venv_bin, elsewhere = tmp_path / "venv" / "bin", tmp_path / "site" / "bin"
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    on_path = fake_binary(elsewhere)
    assert router.router_command() == str(on_path)
    own = fake_binary(venv_bin)
    assert router.router_command() == str(own)


def test_no_router_anywhere_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ServerError, match=f"pip install vllm-router=={router.VERSION}"):
        router.router_command()

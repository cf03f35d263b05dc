"""Which transport ``create_transport`` builds for each setting, and the errors when an engine
that was asked for is not installed (simulated by hiding its module)."""

from __future__ import annotations

import logging
import sys

import pytest
from kv_sides import NUM_BLOCKS, make_caches

from vllm_layerkv.blockio import HostBlockIO
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.layout import KVLayout
from vllm_layerkv.transport import TransportError, create_transport


@pytest.fixture
def blocks() -> HostBlockIO:
    return HostBlockIO(KVLayout.from_kv_caches(make_caches(0), NUM_BLOCKS))


def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import <module>`` fail as if the package were not installed."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_each_engine_can_be_forced(blocks) -> None:
    assert create_transport("tcp", blocks).name == "tcp"
    assert create_transport("nixl", blocks).name == "tcp+nixl"
    assert create_transport("mooncake", blocks).name == "tcp+mooncake"


def test_auto_prefers_nixl_then_mooncake_then_tcp(blocks, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.layerkv.transport"):
        assert create_transport("auto", blocks).name == "tcp+nixl"
    assert "transport=auto: nixl > tcp" in caplog.text
    assert "cuda_ipc: KV is in host memory" in caplog.text  # the reason for what was skipped

    hide(monkeypatch, "nixl", "nixl._api")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.layerkv.transport"):
        assert create_transport("auto", blocks).name == "tcp+mooncake"
    assert "nixl: NIXL is not installed" in caplog.text

    hide(monkeypatch, "mooncake", "mooncake.engine")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.layerkv.transport"):
        assert create_transport("auto", blocks).name == "tcp"
    assert "mooncake: Mooncake is not usable" in caplog.text


def test_forced_nixl_without_nixl_names_the_extra(blocks, monkeypatch) -> None:
    hide(monkeypatch, "nixl", "nixl._api")
    with pytest.raises(TransportError) as e:
        create_transport("nixl", blocks)
    assert "transport=nixl" in str(e.value) and "vllm-layerkv[nixl]" in str(e.value)


def test_forced_mooncake_without_mooncake_names_the_extra(blocks, monkeypatch) -> None:
    hide(monkeypatch, "mooncake", "mooncake.engine")
    with pytest.raises(TransportError) as e:
        create_transport("mooncake", blocks)
    assert "transport=mooncake" in str(e.value)
    assert "vllm-layerkv[mooncake]" in str(e.value) and "libibverbs1" in str(e.value)


def test_unknown_nixl_backend_is_refused_at_start(blocks) -> None:
    with pytest.raises(TransportError, match="NIXL backend.*NOPE"):
        create_transport("nixl", blocks, LayerKVConfig(nixl_backends="NOPE"))


"""Which transport ``create_transport`` builds for each setting, and the errors when an engine
that was asked for is not installed (simulated by hiding its module)."""

from __future__ import annotations

import logging
import sys

import pytest
from kv_sides import NUM_BLOCKS, make_caches

from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
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



# ------------------------------------------------------------------------------ host_bounce


@pytest.mark.parametrize("ucx_tls, bounces", [
    ("tcp,cuda_copy,self", True),        # the UCX-over-tcp setting of the benchmarks
    ("tcp", True),
    ("sm,tcp,cuda_copy", True),
    ("rc,tcp,cuda_copy", False),         # RDMA reaches GPU memory (GPUDirect)
    ("tcp,cuda_ipc,cuda_copy", False),   # CUDA IPC between GPUs of one host
    ("tcp,gdr_copy", False),
    ("all", False),
    ("^cuda_ipc", False),                # an exclusion list: UCX still picks
    ("", False),                         # unset: UCX picks
    (None, False),
])
def test_auto_bounces_nixl_only_when_ucx_cannot_reach_gpu_memory(ucx_tls, bounces) -> None:
    from vllm_layerkv.transport import host_bounce_for

    on, why = host_bounce_for("nixl", "auto", "cuda", "UCX", ucx_tls)
    assert on == bounces, why
    assert why  # the reason is logged at start


def test_host_bounce_auto_leaves_the_rest_alone_and_on_off_are_obeyed() -> None:
    from vllm_layerkv.transport import host_bounce_for

    tcp_only = "tcp,cuda_copy,self"
    assert host_bounce_for("mooncake", "auto", "cuda", "UCX", tcp_only) == (
        False, "mooncake moves GPU memory itself")
    assert host_bounce_for("nixl", "auto", "cpu", "UCX", tcp_only) == (
        False, "the KV is in host memory")
    assert not host_bounce_for("nixl", "auto", "cuda", "UCX,LIBFABRIC", tcp_only)[0]
    assert host_bounce_for("mooncake", "on", "cuda", "UCX", None)[0]
    assert not host_bounce_for("nixl", "off", "cuda", "UCX", tcp_only)[0]


def test_host_bounce_setting_is_validated() -> None:
    from vllm_layerkv.config import ConfigError

    assert LayerKVConfig.from_extra_config({"host_bounce": "on"}).host_bounce == "on"
    with pytest.raises(ConfigError, match="host_bounce='yes': use auto, on or off"):
        LayerKVConfig.from_extra_config({"host_bounce": "yes"})


def test_prefill_bouncing_to_a_decode_without_the_host_ring_writes_directly(caplog) -> None:
    """P has host_bounce on, D off: D offers no host ring, so P says so and writes D's KV
    memory directly; nothing is lost."""
    from kv_sides import assert_copied, push, start_d, start_p, task

    from vllm_layerkv.tasks import RecvTask

    d = start_d(transport="nixl")
    p = start_p("nixl+bounce")
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.layerkv.transport.direct"):
            d.table.expect(RecvTask("r", "t", [3, 4]))
            push(p, [task("t", d, [0, 1], [3, 4], req_id="r")])
            assert p.wait_state("t", ["acked", "failed"]).state == "acked"
        assert "decode offered no receive ring in host memory" in caplog.text
        assert not next(iter(p.sender._channels.values())).bounces
        assert_copied(p, d, [(0, 3), (1, 4)])
    finally:
        p.sender.shutdown()
        d.transport.shutdown()

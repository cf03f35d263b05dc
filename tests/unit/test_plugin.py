"""Loading: the vllm.general_plugins entry point registers "LayerKV" idempotently, and
kv_connector_module_path="vllm_layerkv" resolves the same class without the plugin."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_layerkv.connector import LayerKVConnector
from vllm_layerkv.plugin import register


def test_entry_point_is_installed() -> None:
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "layerkv"]
    assert [e.value for e in eps] == ["vllm_layerkv.plugin:register"]
    assert eps[0].load() is register


def test_register_is_idempotent_and_resolves_by_name() -> None:
    register()
    register()  # vLLM calls plugins once per process, but a second call must not raise
    cfg = KVTransferConfig(kv_connector="LayerKV", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(cfg) is LayerKVConnector


def test_module_path_resolves_without_registry() -> None:
    cfg = KVTransferConfig(kv_connector="LayerKV", kv_role="kv_consumer",
                           kv_connector_module_path="vllm_layerkv")
    assert KVConnectorFactory.get_connector_class(cfg) is LayerKVConnector


def test_connector_class_hooks() -> None:
    assert LayerKVConnector.get_required_kvcache_layout(None) == "HND"
    assert LayerKVConnector.requires_piecewise_for_cudagraph({}) is False
    assert LayerKVConnector.requires_piecewise_for_cudagraph({"piecewise_cudagraph": True})
    assert LayerKVConnector.supports_sleep_mode(None) is False  # vLLM 0.33's sleep mode
    stats = LayerKVConnector.build_kv_connector_stats({"bytes_sent": 10, "groups_sent": 1})
    assert stats is not None and not stats.is_empty()

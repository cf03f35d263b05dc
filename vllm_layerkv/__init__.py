"""LayerKV: a vLLM KV connector that streams KV from prefill to decode layer group by layer group.

Importing this package does not import vLLM. ``LayerKV`` / ``LayerKVConnector`` resolve lazily
so that ``kv_connector_module_path: "vllm_layerkv"`` works (vLLM does
``getattr(module, kv_connector)``) while the proxy and the CLI stay usable on a machine without
vLLM.
"""

from typing import Any

__version__ = "0.1.0"
CONNECTOR_NAME = "LayerKV"


def __getattr__(name: str) -> Any:
    if name in ("LayerKV", "LayerKVConnector"):
        from vllm_layerkv.connector import LayerKVConnector

        return LayerKVConnector
    raise AttributeError(f"module 'vllm_layerkv' has no attribute {name!r}")

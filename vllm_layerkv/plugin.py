"""vLLM general-plugin entry point: makes ``"kv_connector": "LayerKV"`` resolvable with no
module path.

vLLM calls every ``vllm.general_plugins`` entry point once per process (API server, engine core,
workers). ``KVConnectorFactory.register_connector`` raises on a second registration of the same
name, so registration is guarded.
"""

from vllm_layerkv import CONNECTOR_NAME


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_layerkv.connector", "LayerKVConnector"
        )

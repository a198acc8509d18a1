"""vLLM plugin entry point (`vllm.general_plugins`): registers the name "TuttiConnectorV1" so
`"kv_connector": "TuttiConnectorV1"` works without `kv_connector_module_path`."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if "TuttiConnectorV1" not in registry:
        KVConnectorFactory.register_connector("TuttiConnectorV1", "tutti.vllm.connector", "TuttiConnectorV1")

"""vLLM plugin entry point (`vllm.general_plugins`): registers the name "TuttiConnectorV1" so
`"kv_connector": "TuttiConnectorV1"` works without `kv_connector_module_path`, and the secondary
tier type "tutti" for vLLM's OffloadingConnector (TieringOffloadingSpec), which vLLM 0.26 can only
find by a registered name (later versions also take `"type": "TuttiTier", "module_path":
"tutti.vllm.tier"`)."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    for name in ("TuttiConnectorV1", "TuttiHybridConnectorV1"):
        if name not in registry:
            KVConnectorFactory.register_connector(name, "tutti.vllm.connector", name)
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:  # a vLLM without tiered offloading
        return
    if "tutti" not in getattr(SecondaryTierFactory, "_registry", {}):
        SecondaryTierFactory.register_tier("tutti", "tutti.vllm.tier", "TuttiTier")

"""The `vllm.general_plugins` entry point registers "TuttiConnectorV1" with vLLM's factory."""

from importlib.metadata import entry_points


def test_entry_point_is_installed_and_registers_the_name():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tutti"]
    assert eps and eps[0].value == "tutti.vllm.plugin:register"
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # idempotent: vLLM calls it in every process
    assert "TuttiConnectorV1" in KVConnectorFactory._registry
    from vllm.config import KVTransferConfig

    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="TuttiConnectorV1", kv_role="kv_both"))
    from tutti.vllm.connector import TuttiConnectorV1

    assert cls is TuttiConnectorV1


def test_distribution_name_is_ours_and_owns_the_entry_point():
    """Installed as `tutti-kv` (the package index's `tutti` is another project); the entry point
    belongs to that distribution, and no distribution named `tutti` shadows the import package."""
    from importlib.metadata import PackageNotFoundError, distribution

    dist = distribution("tutti-kv")
    assert any(ep.group == "vllm.general_plugins" and ep.name == "tutti" for ep in dist.entry_points)
    try:
        distribution("tutti")
        shadowed = True
    except PackageNotFoundError:
        shadowed = False
    assert not shadowed, "a distribution named 'tutti' is installed: scripts/setup.sh removes it"


def test_the_tier_type_is_registered_for_the_offloading_connector():
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    load_general_plugins()
    from tutti.vllm.tier import TuttiTier

    assert SecondaryTierFactory.get_tier_class({"type": "tutti"}) is TuttiTier
    assert SecondaryTierFactory.get_tier_class({"type": "TuttiTier", "module_path": "tutti.vllm.tier"}) is TuttiTier

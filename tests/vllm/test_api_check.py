"""TuttiConnectorV1 against vLLM's connector base class: every abstract method implemented, every
override taking what vLLM passes. On the installed vLLM (0.32), and on vLLM 0.33's Python code
when TUTTI_VLLM033_SITE names its extracted package (scripts/check_vllm_033.sh; .ci/run sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import check_vllm_api  # noqa: E402


def test_the_installed_vllm_api_is_implemented():
    out = check_vllm_api.check()
    assert out["problems"] == {}, out["problems"]
    assert set(out["abstract_methods"]) <= set(out["checked_overrides"])
    # the connector, its hybrid variant and the OffloadingConnector tier, each against its vLLM base
    assert set(out["classes"]) == {"TuttiConnectorV1 vs KVConnectorBase_V1", "TuttiHybridConnectorV1 vs SupportsHMA",
                                   "TuttiTier vs SecondaryTierManager"}
    tier = out["classes"]["TuttiTier vs SecondaryTierManager"]
    assert set(tier["abstract_methods"]) <= set(tier["checked_overrides"]) and "__init__" in tier["checked_overrides"]


def test_the_check_catches_a_wrong_signature():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    base = KVConnectorBase_V1.get_num_new_matched_tokens

    def renamed(self, req, num_computed_tokens): ...

    def missing(self, request): ...

    def extra_required(self, request, num_computed_tokens, flag): ...

    def fine(self, request, num_computed_tokens, flag=False): ...

    assert "'request' (POSITIONAL_OR_KEYWORD) is missing" in check_vllm_api._compatible(base, renamed)
    assert "'num_computed_tokens' (POSITIONAL_OR_KEYWORD) is missing" in check_vllm_api._compatible(base, missing)
    assert "'flag' is required" in check_vllm_api._compatible(base, extra_required)
    assert check_vllm_api._compatible(base, fine) is None


@pytest.mark.skipif(not os.environ.get("TUTTI_VLLM033_SITE"), reason="vLLM 0.33's code not extracted here "
                    "(scripts/check_vllm_033.sh; .ci/run does it)")
def test_vllm_033_api_is_implemented():
    site = os.environ["TUTTI_VLLM033_SITE"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(REPO)]))
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "check_vllm_api.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    out = json.loads(p.stdout[p.stdout.index("{"):])
    assert out["vllm"] == "0.33.0" and out["vllm_path"].startswith(site)
    assert p.returncode == 0 and out["problems"] == {}, out["problems"]

"""TuttiConnectorV1, TuttiHybridConnectorV1 and TuttiTier against vLLM's base classes: every
abstract method implemented, every override taking what vLLM passes. On the installed vLLM (0.32),
and on vLLM 0.33's and 0.34's Python code where TUTTI_VLLM033_SITE / TUTTI_VLLM034_SITE name their
extracted packages (scripts/check_vllm_033.sh, scripts/check_vllm_034.sh; .ci/run sets both). A
deliberately broken signature must fail the check on each."""

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

SITES = {"0.33.0": "TUTTI_VLLM033_SITE", "0.34.0": "TUTTI_VLLM034_SITE"}


def site_of(version: str) -> str:
    site = os.environ.get(SITES[version])
    if not site:
        pytest.skip(f"vLLM {version}'s code not extracted here (scripts/check_vllm_0{version[2:4]}.sh prints "
                    f"its site; .ci/run sets {SITES[version]})")
    return site


def run_with(site: str, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter importing `site`'s vLLM first (then tutti, scripts/, tests/vllm/)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(REPO), str(REPO / "scripts"),
                                                       str(REPO / "tests" / "vllm")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def result_of(p: subprocess.CompletedProcess) -> dict:
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][7:])


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


@pytest.mark.parametrize("version", SITES)
def test_the_extracted_vllm_api_is_implemented(version):
    site = site_of(version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(REPO)]))
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "check_vllm_api.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    out = json.loads(p.stdout[p.stdout.index("{"):])
    assert out["vllm"] == version and out["vllm_path"].startswith(site)
    assert p.returncode == 0 and out["problems"] == {}, out["problems"]
    assert set(out["classes"]) == {"TuttiConnectorV1 vs KVConnectorBase_V1", "TuttiHybridConnectorV1 vs SupportsHMA",
                                   "TuttiTier vs SecondaryTierManager"}
    assert set(out["abstract_methods"]) <= set(out["checked_overrides"])
    if version >= "0.34":  # the base class gained may_load_async: tutti's override is checked against it
        assert "may_load_async" in out["checked_overrides"]


BREAK = """
import runpy
from tutti.vllm.connector import TuttiConnectorV1
from tutti.vllm.tier import TuttiTier

def get_num_new_matched_tokens(self, req, num_computed_tokens): ...   # 'request' renamed
def submit_load(self, job): ...                                      # 'job_metadata' renamed
def may_load_async(self, request, batch_full): ...                   # a parameter vLLM never passes
TuttiConnectorV1.get_num_new_matched_tokens = get_num_new_matched_tokens
TuttiTier.submit_load = submit_load
TuttiConnectorV1.may_load_async = may_load_async
try:
    runpy.run_path(SCRIPT, run_name="__main__")
except SystemExit as e:
    print("EXIT", e.code)
"""


@pytest.mark.parametrize("version", SITES)
def test_a_broken_signature_fails_the_check(version):
    """The same check .ci/run runs, with three of tutti's signatures broken on purpose: it exits 1
    naming each (may_load_async only where vLLM's base has it, 0.34+)."""
    p = run_with(site_of(version), BREAK.replace("SCRIPT", repr(str(REPO / "scripts" / "check_vllm_api.py"))))
    assert "EXIT 1" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(p.stdout[p.stdout.index("{"):p.stdout.rindex("}") + 1])
    assert out["vllm"] == version
    problems = out["problems"]
    assert "'request' (POSITIONAL_OR_KEYWORD) is missing" in problems["TuttiConnectorV1.get_num_new_matched_tokens"]
    assert "'job_metadata' (POSITIONAL_OR_KEYWORD) is missing" in problems["TuttiTier.submit_load"]
    if version >= "0.34":
        assert "'batch_full' is required" in problems["TuttiConnectorV1.may_load_async"]
    else:
        assert "TuttiConnectorV1.may_load_async" not in problems  # 0.33's base has none: nothing to break


CONSULTED = """
import inspect, json
from types import SimpleNamespace

import vllm
from vllm.config import SchedulerConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

import scheduler_half_kit as kit
from tutti.vllm import compat
from tutti.vllm.connector import TuttiConnectorV1

out = {"vllm": vllm.__version__, "has": compat.HAS_MAY_LOAD_ASYNC,
       "base": list(inspect.signature(KVConnectorBase_V1.may_load_async).parameters),
       "ours": list(inspect.signature(TuttiConnectorV1.may_load_async).parameters),
       "overridden": "may_load_async" in vars(TuttiConnectorV1),
       "knob_field": "max_num_inflight_kv_loads" in getattr(SchedulerConfig, "__dataclass_fields__", {}),
       "knob_read": compat.max_inflight_kv_loads(SimpleNamespace(scheduler_config=SimpleNamespace(
           max_num_inflight_kv_loads=4)))}

p = kit.planner(asynchronous=True)
toks = kit.prompt(1, 5 * kit.T + 3)
kit.store(p, toks)
conn = TuttiConnectorV1.__new__(TuttiConnectorV1)
conn._sched, conn._work = kit.half(p, async_loads=True), None
asked = []
answer = conn._sched.may_load_async
def spy(request):
    asked.append(request.request_id)
    return answer(request)
conn._sched.may_load_async = spy


class Queue(list):
    def add_request(self, request):
        self.append(request.request_id)


def enqueue(request, inflight):
    # vLLM 0.34's own code choosing the waiting queue of a request (Scheduler._enqueue_waiting_request)
    fake = SimpleNamespace(connector=conn, scheduler_config=SimpleNamespace(max_num_inflight_kv_loads=inflight),
                           deferred_waiting=set(), kv_holding_waiting=Queue(), async_kv_waiting=Queue(),
                           waiting=Queue(), _is_blocked_waiting_status=Scheduler._is_blocked_waiting_status,
                           _holds_kv_blocks=Scheduler._holds_kv_blocks)
    Scheduler._enqueue_waiting_request(fake, request)
    return [q for q in ("kv_holding_waiting", "async_kv_waiting", "waiting") if getattr(fake, q)]


def request(i, tokens):
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=4), None)


out["prompt_type"] = type(request(0, toks).prompt_token_ids).__name__
out["hit"] = enqueue(request(1, toks), 4)
out["miss"] = enqueue(request(2, kit.prompt(2, 5 * kit.T)), 4)
out["no_knob"] = enqueue(request(3, toks), None)
out["asked"] = asked
print("RESULT", json.dumps(out))
"""


def test_vllm_034_consults_may_load_async():
    """vLLM 0.34's scheduler code, with --max-num-inflight-kv-loads set, asks TuttiConnectorV1 when
    a request enters its waiting queues and puts a stored prompt (a hit tutti loads asynchronously)
    in the queue whose loads start while the batch is full, a miss in the plain one; without the
    knob it never asks. Its Request holds prompts in a TokenBuffer, which tutti's keys read."""
    out = result_of(run_with(site_of("0.34.0"), CONSULTED))
    assert out["vllm"] == "0.34.0" and out["has"] and out["overridden"]
    assert out["base"] == out["ours"] == ["self", "request"]
    assert out["knob_field"] and out["knob_read"] == 4
    assert out["prompt_type"] == "TokenBuffer"
    assert out["hit"] == ["async_kv_waiting"] and out["miss"] == ["waiting"]
    assert out["no_knob"] == ["waiting"] and out["asked"] == ["r1", "r2"]


@pytest.mark.parametrize("version", SITES)
def test_the_tier_runs_through_the_extracted_vllms_tier_interface(version):
    """TuttiTier's tests (test_tier.py, test_tier_recency.py) on 0.33's / 0.34's own TransferJob,
    JobResult, LookupResult and tier factory (0.34: no touch(), recency from loads). Left out: the
    three that build a VllmConfig, which these CUDA builds cannot do on a machine with no GPU."""
    site = site_of(version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(REPO)]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/vllm/test_tier.py", "tests/vllm/test_tier_recency.py",
                        "-k", "not auto_dtype and not checkpoint_replaced"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 passed" not in p.stdout and "failed" not in p.stdout
    # the tests imported this vLLM's tier interface, not the installed one
    probe = run_with(site, "import json, vllm.v1.kv_offload.tiering.base as b; "
                           "print('RESULT', json.dumps([b.__file__, hasattr(b.SecondaryTierManager, 'touch')]))")
    where, touch = result_of(probe)
    assert where.startswith(site) and touch == (version < "0.34")

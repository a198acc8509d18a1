"""Hit policies side by side: what each decides on a grid of storages, prompts and modes, in
the cost model's own terms, and how long a decision takes on the scheduler's thread.

Why: a researcher trying a policy (`hit_policy`: a registered name or "package.module:attr")
wants its decisions before a GPU run: how many tokens it loads in the step (layer-wise, under
the prompt's own compute), how many asynchronously (the request waits outside the batch), how
many it recomputes by choice, and what the model says each costs against recomputing. The
grid uses the H200's measured rates (results/load_or_compute.md, the 8B 32k layer-wise hit in
load_or_compute/2026-12-03_8b_32k_attention_policy.json: 42.9k token-equivalents/s of prefill,
the 8B geometry's 128 KiB a token, attention counted) and storages from RAM to a network file
system. The model is the one `auto` minimises, so `auto`
is never worse than either end there by construction; the figures that count are the GPU's.

Run:
    python3 bench/test_policy_bench.py                  # a table per policy (auto, always, never)
    python3 bench/test_policy_bench.py --policy my.module:MyPolicy
    tutti bench policy                                  # pytest-benchmark: decision time, decisions in extra_info
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tutti.engine.sched.hit_policy import CostModel, HitQuery, Rates, attention_weight, get_policy  # noqa: E402

B8 = 128 * 1024  # KV bytes a token of the 8B geometry moves (32 layers x 8 heads x 128 x K,V x bf16)
W8 = attention_weight(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32, attention_layers=32)
PREFILL = 42893.0  # token-equivalents/s at zero context (H200: load_or_compute/2026-12-03_8b_32k_attention_policy.json)
STORAGES = {"ram": 50e9, "nvme": 6e9, "virtio_disk": 2.1e9, "network_fs": 0.5e9}
PROMPTS = (8192, 32768)
# (name, asynchronous, step budget, other requests in the batch, step seconds)
MODES = (("layerwise_budget32k", False, 32768, 0, 0.0), ("layerwise_budget8k", False, 8192, 0, 0.0),
         ("async_alone", True, 8192, 0, 0.0066), ("async_batch7", True, 8192, 7, 0.0066))


@dataclass
class Case:
    storage: str
    prompt: int
    mode: str
    query: HitQuery
    rates: Rates


def grid() -> list[Case]:
    out = []
    for storage, rate in STORAGES.items():
        for n in PROMPTS:
            for mode, asynchronous, step, batch, step_s in MODES:
                hit = n - 256  # the last chunk is the prompt's own suffix
                q = HitQuery(hit_tokens=hit, prompt_tokens=n, chunk_tokens=256, bytes_per_token=B8, step_tokens=step,
                             asynchronous=asynchronous, attention_weight=W8)
                out.append(Case(storage, n, mode, q, Rates(rate, PREFILL, step_s=step_s, batch_requests=batch)))
    return out


def decide_all(policy, cases: list[Case]) -> list[dict]:
    """Each case's decision, split as the Prometheus counters split it, with the model's time."""
    rows = []
    for c in cases:
        m = max(0, min(int(policy.decide(c.query, c.rates)), c.query.hit_tokens))
        recompute = CostModel.time(c.query, c.rates, 0)
        t = CostModel.time(c.query, c.rates, m)
        rows.append({"storage": c.storage, "prompt": c.prompt, "mode": c.mode,
                     "loaded_in_step": 0 if c.query.asynchronous else m,
                     "loaded_async": m if c.query.asynchronous else 0,
                     "recomputed_by_choice": c.query.hit_tokens - m,
                     "model_s": round(t, 4), "x_recompute": round(t / recompute, 3),
                     # what `auto` minimises: the request's time plus what it adds to the batch's
                     "x_recompute_batch_counted": round(CostModel.cost(c.query, c.rates, m)
                                                        / CostModel.cost(c.query, c.rates, 0), 3)})
    return rows


def table(name: str, rows: list[dict]) -> str:
    lines = [f"policy {name}", "| storage | prompt | mode | loaded in step | loaded async | recomputed by choice | "
             "model s (the request's) | x recompute | x recompute, the batch's waits counted |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['storage']} | {r['prompt']} | {r['mode']} | {r['loaded_in_step']} | {r['loaded_async']} | "
              f"{r['recomputed_by_choice']} | {r['model_s']} | {r['x_recompute']} | {r['x_recompute_batch_counted']} |"
              for r in rows]
    return "\n".join(lines)


def _policies() -> list[str]:
    extra = os.environ.get("TUTTI_POLICY_BENCH", "")
    return ["auto", "always", "never"] + [p for p in extra.split(",") if p]


try:
    import pytest

    @pytest.mark.parametrize("name", _policies())
    def test_policy_decisions(benchmark, name):
        """Time of one pass of decisions over the grid; the decisions themselves in extra_info."""
        policy, cases = get_policy(name), grid()
        rows = benchmark(decide_all, policy, cases)
        benchmark.extra_info["decisions"] = rows
        benchmark.extra_info["decisions_per_pass"] = len(cases)
        print("\n" + table(name, rows))
except ImportError:  # pragma: no cover - the table works without pytest
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", action="append", default=[],
                    help="a registered name or package.module:attr (repeatable; default auto, always, never)")
    a = ap.parse_args()
    for name in a.policy or ["auto", "always", "never"]:
        print(table(name, decide_all(get_policy(name), grid())) + "\n")


if __name__ == "__main__":
    main()

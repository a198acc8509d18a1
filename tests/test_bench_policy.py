"""bench/test_policy_bench.py (`tutti bench policy`): the decisions' split and the model's verdicts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import test_policy_bench as pb  # noqa: E402
from tutti.engine.sched.hit_policy import get_policy  # noqa: E402


def test_each_decision_is_split_as_the_counters_split_it_and_auto_is_never_worse_in_its_model():
    cases = pb.grid()
    rows = {name: pb.decide_all(get_policy(name), cases) for name in ("auto", "always", "never")}
    for c, a, al, nv in zip(cases, rows["auto"], rows["always"], rows["never"]):
        for r in (a, al, nv):
            assert r["loaded_in_step"] + r["loaded_async"] + r["recomputed_by_choice"] == c.query.hit_tokens
            assert (r["loaded_async"] == 0) if not c.query.asynchronous else (r["loaded_in_step"] == 0)
        assert nv["recomputed_by_choice"] == c.query.hit_tokens and nv["x_recompute"] == 1.0
        assert al["recomputed_by_choice"] == 0
        # what auto minimises (the batch's waits counted), against both ends
        assert a["x_recompute_batch_counted"] <= min(al["x_recompute_batch_counted"], 1.0) + 1e-3
    # the grid's extremes: RAM loads everything it can, a network file system alone recomputes
    by = {(r["storage"], r["prompt"], r["mode"]): r for r in rows["auto"]}
    assert by[("ram", 32768, "async_alone")]["loaded_async"] == 32512
    assert by[("network_fs", 8192, "async_alone")]["recomputed_by_choice"] == 7936
    table = pb.table("auto", rows["auto"])
    assert table.count("\n") == len(cases) + 2 and "| ram | 8192 | layerwise_budget32k |" in table

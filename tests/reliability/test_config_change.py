"""A server restarted with another model, dtype, block size, weights or parallel layout over an
existing root never serves a chunk of the old configuration: hit tokens 0, outputs equal to
recompute under the new configuration, and the old namespace is left whole."""

from __future__ import annotations

import json
import shutil

import harness
from relkit import CHUNK, connector_of, engine, kv_config, prompt, reference, tokens, verify_store, write_weights

AREA = "configuration change"
C = 2 * CHUNK  # chunk 64: valid for block sizes 32 and 64
PROMPT_LEN = 3 * C + 9


def test_new_configuration_never_hits_old_chunks(tiny_model, tmp_path, report):
    model = tmp_path / "model"  # a copy we may edit in place
    shutil.copytree(tiny_model, model)
    write_weights(model, seed=1)
    root = tmp_path / "kv"
    kvt = kv_config(root, chunk=C)
    real = {"load_format": "safetensors"}  # real weight files, so a checkpoint can change in place
    prompts = [prompt(900 + i, PROMPT_LEN) for i in range(3)]
    # (what changed, engine kwargs); the model edits in place come last. A chunk's packed bytes
    # would fit after a block size change, but its values were computed by attention kernels
    # that accumulate per block: they differ in the last bits, enough to change greedy tokens.
    changes = [
        ("dtype float32 -> bfloat16", {"dtype": "bfloat16"}),
        ("block_size 32 -> 64", {"block_size": 64}),
        ("checkpoint replaced in place (same path, config and file size)", {}),
        ("model config edited in place (2 -> 3 layers)", {}),
    ]
    old_want = reference(model, prompts, 4, **real)
    with engine(model, kvt, **real) as llm:
        assert tokens(harness.generate_ids(llm, prompts, 4)) == old_want
        harness.settle(llm)
        assert connector_of(llm).planner.stats.stores_committed == 9
    first = verify_store(root)
    first_digest, old = next(iter(first.items()))
    assert old["entries"] == 9

    rows = []
    for what, kw in changes:
        if what.startswith("checkpoint"):
            write_weights(model, seed=2)
        if what.startswith("model config"):
            cfg = json.loads((model / "config.json").read_text())
            cfg["num_hidden_layers"] = 3
            (model / "config.json").write_text(json.dumps(cfg))
            write_weights(model, seed=3)
        want = reference(model, prompts, 4, **real, **kw)
        if what.startswith("checkpoint"):  # new weights: the old KV would be wrong, not merely stale
            assert want != old_want, f"{what}: the new weights do not change the outputs"
        with engine(model, kvt, **real, **kw) as llm:
            conn = connector_of(llm)
            resident = len(conn.planner.index)
            outs = harness.generate_ids(llm, prompts, 4)
            harness.settle(llm)
            s = dict(vars(conn.planner.stats))
        assert tokens(outs) == want, what
        assert s["loads_failed"] == 0, (what, s)
        rows.append((what, resident, s["hit_tokens"]))
        assert resident == 0 and s["hit_tokens"] == 0, (what, s)
        assert s["stores_committed"] == 9, (what, s)  # stored under its own namespace
    # parallel layout: tensor / pipeline parallel geometries over the same root see nothing
    layouts = _parallel_layouts(root, C, first_digest)
    summary = verify_store(root)
    assert len(summary) == 1 + len(changes)
    assert all(ns["bad"] == [] and ns["entries"] == 9 for ns in summary.values())
    assert summary[first_digest]["keys"] == old["keys"]  # the old namespace is untouched
    report.tried = "; ".join(w for w, _ in changes) + "; tensor/pipeline parallel size 1 -> 2 (planner over the root)"
    report.held = ("each new configuration: 0 resident chunks at start, 0 hit tokens, outputs == its own "
                   "recompute, stores in its own namespace; the old namespace stays whole (9 chunks, checksums pass)")
    report.requests = 3 * (1 + len(changes))
    report.faults = len(changes) + layouts
    report.bytes_lost = 0
    report.counts = {"namespaces": len(summary), "old_chunks_hit_after_incompatible_change": sum(r[2] for r in rows)}


def _parallel_layouts(root, chunk: int, first_digest: str) -> int:
    """The scheduler's index for TP=2 / PP=2 geometries of the same model over the same root: empty."""
    from tutti.engine.build import Geometry, build_planner

    from tutti.store.chunk_store import list_namespaces

    # the geometry the first server used, read back from its manifest
    fp = next(n.manifest["fingerprint"] for n in list_namespaces(str(root)) if n.digest == first_digest)
    extra = dict(fp["extra"])
    base = dict(model=fp["model"], cache_dtype=fp["cache_dtype"], chunk_tokens=chunk,
                block_size=int(extra["block_size"]), model_id=extra["model_id"], num_layers=fp["num_layers"],
                num_heads=fp["num_heads"], content_bytes=fp["content_bytes"])
    same = build_planner({"root": str(root), "capacity_bytes": "16MiB", "chunk_tokens": chunk}, Geometry(**base))
    assert len(same.index) > 0  # control: the original geometry does see its chunks
    n = 0
    for geom in (Geometry(**{**base, "num_heads": base["num_heads"] // 2, "tp_size": 2}),
                 Geometry(**{**base, "num_layers": base["num_layers"] // 2, "pp_size": 2})):
        planner = build_planner({"root": str(root), "capacity_bytes": "16MiB", "chunk_tokens": chunk}, geom)
        assert len(planner.index) == 0 and planner.seed != same.seed
        n += 1
    return n

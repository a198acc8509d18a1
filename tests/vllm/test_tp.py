"""Tensor parallelism (TP=2) with the real vLLM CPU build: two worker processes (gloo, the "mp"
executor), each storing and loading its own shard in its own namespace.

vLLM's dummy loader draws each rank's weight shard from the seed, so TP=2 weights differ from
TP=1 weights: the reference for the tokens is the TP=2 run that computed everything.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

import harness
from connector_kit import CHUNK, kv_config, prompt

TP_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # auto-binding wants one NUMA node per rank
    "OMP_NUM_THREADS": "1",  # two workers on a 2-core machine
}
PROMPT_LEN = 300  # 4 whole chunks of 64 tokens and a 44-token tail

CHILD = r'''
import json, harness
from vllm.distributed.kv_transfer import get_kv_transfer_group

def flush_and_describe(worker):
    """In each worker process: finish pending stores, say what this rank holds."""
    w = get_kv_transfer_group().worker
    w.flush()
    return {"tp_rank": w.store.fingerprint.tp_rank, "ns": w.store.namespaces[0], "entries": len(w.store.entries())}

llm = harness.make_llm(MODEL, kv_transfer_config=KVT, tensor_parallel_size=2, distributed_executor_backend="mp")
conn = harness.connector(llm)

def phase():
    before = conn.planner.stats.copy()  # this phase's counters only
    outs = harness.generate_ids(llm, PROMPTS, 8)
    ranks = llm.collective_rpc(flush_and_describe)
    harness.generate_ids(llm, [[5, 6, 7]], 1)  # one more step delivers the last reports
    return {"outs": [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens} for o in outs],
            "stats": conn.planner.stats.since(before), "ranks": ranks, "resident": len(conn.planner.index),
            "num_workers": conn.planner.num_workers, "num_writers": conn.planner.num_writers}

results = [phase()]
if CORRUPT is not None:  # flip a byte of one rank's slab while the engine runs, then ask again
    path, off = CORRUPT
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    llm.reset_prefix_cache()  # vLLM's own cache forgets: the hit must come from tutti
    results.append(phase())
print("RESULT", json.dumps(results))
harness.shutdown_llm(llm)
'''


def tp_run(model_dir, root: Path, prompts, corrupt=None) -> list[dict]:
    code = (f"MODEL = {str(model_dir)!r}\nKVT = {kv_config(root)!r}\nPROMPTS = {prompts!r}\n"
            f"CORRUPT = {corrupt!r}\n" + CHILD)
    out = harness.run_in_subprocess(code, env=TP_ENV, timeout=240)
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])


def rank_stores(root: Path):
    """tp_rank -> a reader ChunkStore over that rank's namespace on disk."""
    from tutti.store.fingerprint import Fingerprint
    from tutti.store.chunk_store import ChunkStore, list_namespaces

    out = {}
    for ns in list_namespaces(str(root)):
        fp = Fingerprint.from_dict(ns.manifest["fingerprint"])
        out[fp.tp_rank] = ChunkStore(str(root), fp, capacity_bytes=64 << 20, writer=False)
    return out


def rank_entries(root: Path) -> dict[int, dict[int, bytes]]:
    """tp_rank -> {slot: key}, read from each rank's journal on disk."""
    out = {}
    for rank, st in rank_stores(root).items():
        with st:
            out[rank] = {slot: e.key for slot, e in st.entries().items()}
    return out


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """A TP=2 engine computed the prompt and stored its chunks on both ranks."""
    root = tmp_path_factory.mktemp("tp") / "kv"
    p = prompt(1, PROMPT_LEN)
    (res,) = tp_run(tiny_model, root, [p])
    return root, p, res


@pytest.fixture(scope="module")
def reloaded(tiny_model, stored, tmp_path_factory):
    """A fresh TP=2 process over a copy of that store: the prompt again (loaded from both ranks),
    then, after one byte of rank 1's shard of the first chunk (layer 1) is flipped, once more."""
    root, p, _ = stored
    root2 = tmp_path_factory.mktemp("tp-reload") / "kv"
    shutil.copytree(root, root2)
    before = rank_entries(root2)
    slot0 = min(before[1])  # the prompt's first chunk
    stores = rank_stores(root2)
    st = stores[1]
    path, (_, off), seg_bytes = st.slab_path(slot0), st.location(slot0, 1), st.segment_bytes
    for st in stores.values():
        st.close()
    loaded, corrupted = tp_run(tiny_model, root2, [p], corrupt=(path, off + 1000))
    return dict(root=root2, before=before, slot0=slot0, seg_bytes=seg_bytes, loaded=loaded, corrupted=corrupted)


def test_store_on_both_ranks(stored):
    root, _, res = stored
    s = res["stats"]
    assert res["num_workers"] == res["num_writers"] == 2
    assert res["outs"][0]["cached"] == 0
    assert s["stores_planned"] == 4 and s["stores_committed"] == 4 and s["stores_failed"] == 0
    # every rank stored every chunk in its own namespace
    assert sorted(r["tp_rank"] for r in res["ranks"]) == [0, 1]
    assert len({r["ns"] for r in res["ranks"]}) == 2 and all(r["entries"] == 4 for r in res["ranks"])
    per_rank = rank_entries(root)
    assert sorted(per_rank) == [0, 1] and per_rank[0] == per_rank[1] and len(per_rank[0]) == 4


def test_store_then_load_in_a_fresh_process(stored, reloaded):
    first, res = stored[2], reloaded["loaded"]
    s = res["stats"]
    assert res["outs"][0]["cached"] == 4 * CHUNK
    assert s["hit_tokens"] == 4 * CHUNK and s["loads_failed"] == 0
    assert s["stores_planned"] == 0 and s["bytes_stored"] == 0  # nothing stored again
    # both ranks loaded all 4 chunks x 2 layers of their own shard
    assert s["bytes_loaded"] == 2 * 4 * 2 * reloaded["seg_bytes"]
    assert first["stats"]["bytes_stored"] == s["bytes_loaded"]
    assert res["outs"][0]["tokens"] == first["outs"][0]["tokens"]


def test_corrupt_shard_on_one_rank_is_recomputed_on_both(stored, reloaded):
    first, res = stored[2], reloaded["corrupted"]
    s = res["stats"]
    # the ranks agreed: identical tokens to the run that computed everything
    assert res["outs"][0]["tokens"] == first["outs"][0]["tokens"]
    assert s["hit_tokens"] == 4 * CHUNK and s["loads_failed"] == 1
    # both ranks loaded all 8 segments: checksums are compared on the device and read back once,
    # after the step (rank 0's good data and rank 1's bad chunk are both recomputed)
    assert s["bytes_loaded"] == (8 + 8) * reloaded["seg_bytes"]
    assert res["resident"] == 3  # the chunk was dropped from the index; chunks 1-3 stay
    after, before, slot0 = rank_entries(reloaded["root"]), reloaded["before"], reloaded["slot0"]
    assert slot0 not in after[1] and after[0] == before[0]  # rank 1 journaled the slot free
    from tutti.engine.sched.planner import rebuild_entries

    assert slot0 not in rebuild_entries([after[0], after[1]])  # a restart does not hit on it


def test_vllm_aggregates_tp_worker_outputs_the_way_the_planner_counts():
    """vLLM's KVOutputAggregator (the mp executor's merge of every rank's output): worker
    metadata is concatenated (one ticket per rank), finished_sending needs every rank,
    invalid blocks are unioned. Plans and reports survive pickling to worker processes."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from tutti.engine.plan import WorkerReport
    from tutti.engine.sched.planner import Planner
    from tutti.vllm.connector import TuttiConnectorMetadata, TuttiWorkerMetadata

    planner = Planner(num_slots=8, chunk_tokens=64, block_size=32, seed=b"s" * 32, num_workers=2)
    tokens = list(range(4, 4 + 129))
    planner.match("r", tokens, 0)
    planner.on_alloc("r", list(range(5)), 0)
    planner.update_request("r", tokens=tokens, all_block_ids=list(range(5)))
    plan = planner.build_step({"r": len(tokens)}, {"r": 0})
    t1, t2 = (st.ticket for st in plan.stores)
    meta = pickle.loads(pickle.dumps(TuttiConnectorMetadata(plan)))
    assert meta.plan == plan

    agg = KVOutputAggregator(expected_finished_count=2)

    def step(*per_rank):
        outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            finished_sending=fs, invalid_block_ids=bad,
            kv_connector_worker_meta=pickle.loads(pickle.dumps(TuttiWorkerMetadata(rep)))))
            for rep, fs, bad in per_rank]
        out = agg.aggregate(outs).kv_connector_output
        planner.on_report(out.kv_connector_worker_meta.report)
        return out

    # rank 0 stored both chunks, rank 1 only the first; rank 1 failed a load of blocks 7, 8
    out = step((WorkerReport(stored=[t1, t2], steps_done=[plan.step]), None, set()),
               (WorkerReport(stored=[t1], steps_done=[plan.step]), None, {7, 8}))
    assert out.invalid_block_ids == {7, 8}
    assert sorted(out.kv_connector_worker_meta.report.stored) == sorted([t1, t2, t1])
    keys = [st.key for st in plan.stores]
    assert keys[0] in planner.index and keys[1] not in planner.index  # t2 waits for rank 1
    # finished_sending: the request is released only once every rank reported it
    assert planner.finished("r") is True
    out = step((WorkerReport(), {"r"}, set()), (WorkerReport(stored=[t2]), None, set()))
    assert not out.finished_sending and keys[1] in planner.index
    out = step((WorkerReport(), None, set()), (WorkerReport(), {"r"}, set()))
    assert out.finished_sending == {"r"}
    assert planner.stats.stores_committed == 2


def test_mla_geometry_from_vllm_config_is_stored_once():
    """The connector's geometry for an MLA model marks the latent as replicated over TP ranks:
    every rank maps to TP rank 0's namespace, and only TP rank 0 writes."""
    from types import SimpleNamespace

    import torch

    from tutti.vllm import translate

    def cfg(use_mla):
        mc = SimpleNamespace(model="m", dtype=torch.bfloat16, use_mla=use_mla, get_head_size=lambda: 576,
                             get_num_kv_heads=lambda pc: 1 if use_mla else 4, get_num_layers=lambda pc: 3)
        return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=64),
                               parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))

    mla = translate.geometry(cfg(True), 256)
    assert mla.kv_replicated and (mla.num_heads, mla.content_bytes) == (1, 576 * 2)
    ranks = [mla.for_rank(tp) for tp in range(2)]
    assert [g.writes for g in ranks] == [True, False] and mla.num_writers == 1
    assert ranks[0].fingerprint() == ranks[1].fingerprint() and ranks[1].fingerprint().tp_rank == 0
    mha = translate.geometry(cfg(False), 256)
    assert not mha.kv_replicated and mha.num_writers == 2
    assert mha.for_rank(0).fingerprint() != mha.for_rank(1).fingerprint()

"""FULL CUDA graphs with tutti in vLLM's default mode: identical tokens to recompute.

vLLM replays a FULL graph for a uniform decode batch, and runs no per-layer hooks in it. Two
such steps carry tutti work: a request whose prompt is a hit but for its last token joins a
decode batch as a one-token step (its loads are done before the forward), and with
`store_decode` a chunk completed by generated tokens is stored from a decode step. Each case
runs in its own process (no connector, then tutti) with the same requests at the same steps;
the driver compares every request's tokens and prints one JSON line.

    python3 scripts/gpu_full_graph.py --out /tmp/full_graph     # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
from subcase import emit, run_case as run_subcase  # noqa: E402
from vllm_ttft import prompt, run_joining  # noqa: E402

CHUNK = 256


def make_model(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=8, head_dim=128, vocab_size=8192, architectures=["LlamaForCausalLM"],
               model_type="llama", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
               hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def run_case(case: str, model: str, root: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kw = dict(model=model, skip_tokenizer_init=True, load_format="dummy", seed=0, gpu_memory_utilization=0.3,
              max_model_len=4096, enable_prefix_caching=True, dtype="bfloat16",
              kernel_config={"enable_flashinfer_autotune": False, "enable_cutedsl_warmup": False})
    if case == "tutti":
        kw["kv_transfer_config"] = {
            "kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                "root": root, "capacity_bytes": "4GiB", "chunk_tokens": CHUNK, "store_decode": True}}
    llm = LLM(**kw)
    eng = llm.llm_engine
    mode = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, detokenize=False, ignore_eos=True)  # noqa: E731

    worker = None
    if case == "tutti":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker

    def settle() -> None:
        if worker is not None:
            worker.flush()
        for _ in range(3):  # deliver the workers' reports to the scheduler
            llm.generate([{"prompt_token_ids": prompt(999, 8, 8000)}], greedy(1), use_tqdm=False)
        llm.reset_prefix_cache()

    p_hit = prompt(1, 2 * CHUNK + 1, 8000)  # every token but the last in whole chunks
    llm.generate([{"prompt_token_ids": p_hit}], greedy(1), use_tqdm=False)  # stores 2 chunks (tutti)
    settle()

    def run(requests: dict[str, tuple[list[int], int]], join: dict[str, int]) -> dict[str, dict]:
        return run_joining(eng, requests, join, greedy)

    before = dict(worker.whole_steps) if worker else {}
    # 1) six requests decoding; at step 4 the hit joins them as a one-token step (FULL graph)
    reqs = {f"d{i}": (prompt(100 + i, 100, 8000), 40) for i in range(6)}
    reqs["hit"] = (p_hit, 16)
    res1 = run(reqs, {"hit": 4})
    mid = dict(worker.whole_steps) if worker else {}
    # 2) store_decode: 200 prompt tokens + 120 generated complete chunk 0 in a decode step
    q = prompt(7, 200, 8000)
    res2 = run({"q": (q, 120)}, {})
    settle()
    q2 = q + res2["q"]["tokens"][:100]  # chunk 0 = prompt + 56 generated tokens: a hit (tutti)
    res3 = run({"q2": (q2, 16)}, {})
    after = dict(worker.whole_steps) if worker else {}
    st = {}
    if worker is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from tutti.vllm import internals

        planner = internals.engine_scheduler(llm).connector.planner
        st = {k: getattr(planner.stats, k) for k in ("hit_tokens", "stores_committed", "loads_failed")}
        st["recent_steps"] = list(worker.recent_steps)
    return {"case": case, "cudagraph_mode": mode, "batch": res1, "decode_store": res2, "decode_hit": res3,
            "whole_steps_batch": {k: mid.get(k, 0) - before.get(k, 0) for k in mid},
            "whole_steps_decode": {k: after.get(k, 0) - mid.get(k, 0) for k in after}, "stats": st}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="")
    ap.add_argument("--out", default="/tmp/full_graph")
    ap.add_argument("--model", default="")
    ap.add_argument("--root", default="/dev/shm/tutti-full-graph")
    a = ap.parse_args()
    if a.case:
        emit(run_case(a.case, a.model, a.root))
        return
    os.makedirs(a.out, exist_ok=True)
    model = make_model(os.path.join(a.out, "model"))
    shutil.rmtree(a.root, ignore_errors=True)
    res = {}
    for case in ("recompute", "tutti"):
        res[case], err = run_subcase([sys.executable, __file__, "--case", case, "--model", model, "--root", a.root],
                                     timeout=400)
        res[case]["tutti_log"] = [l for l in err.splitlines() if "tutti" in l][-40:]
    ok = all("error" not in r for r in res.values())
    summary = {"ok": ok}
    if ok:
        ref, tut = res["recompute"], res["tutti"]
        summary.update(
            cudagraph_mode=tut["cudagraph_mode"],
            batch_tokens_equal={k: ref["batch"][k]["tokens"] == tut["batch"][k]["tokens"] for k in ref["batch"]},
            hit_cached_tokens=tut["batch"]["hit"]["cached"],
            decode_store_tokens_equal=ref["decode_store"]["q"]["tokens"] == tut["decode_store"]["q"]["tokens"],
            decode_hit_tokens_equal=ref["decode_hit"]["q2"]["tokens"] == tut["decode_hit"]["q2"]["tokens"],
            decode_hit_cached_tokens=tut["decode_hit"]["q2"]["cached"],
            whole_steps_batch=tut["whole_steps_batch"], whole_steps_decode=tut["whole_steps_decode"],
            stats=tut["stats"], tutti_log=tut["tutti_log"][-12:])
    with open(os.path.join(a.out, "full_graph.json"), "w") as f:
        json.dump({"summary": summary, "cases": res}, f, indent=1)
    print("FULL_GRAPH " + json.dumps(summary))


if __name__ == "__main__":
    main()

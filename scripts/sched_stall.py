"""Does a deferred lookup stall vLLM's scheduler under KV pressure? vLLM's own Scheduler (the
version on the path), a connector that answers one request "later" (None: a staged hit, or
vLLM's tiering deferring a lookup) while the requests behind it load asynchronously, and
no model: each step's outputs are made here (one token a prefill ends, loads received after
`--load-steps` steps). Why: on vLLM 0.26 a deferred request that then cannot get its blocks
stops the scheduler at it, in one queue with loaded requests that hold their blocks
(vllm-project/vllm#57841). `--guard` answers the deferred request "later" until its whole
sequence fits the free blocks less those reserved for loads in flight, as tutti's
`_waits_for_blocks` does, so vLLM passes over it.

    PYTHONPATH=DIR_WITH_VLLM_0_26 python3 scripts/sched_stall.py --model DIR [--guard] [--sweep]

Prints one JSON line a run: the vLLM version, requests finished, steps, and whether it stalled (50
steps scheduling nothing while requests wait and no load is in flight). `--sweep` runs a grid of
block counts, loaders, deferrals and load times, with and without the guard, and prints how many
stalled (results/sched_stall.md).
"""

from __future__ import annotations

import argparse
import json
import random

import vllm
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BS = 16
STATE = {"step": 0, "guard": False, "defer_until": 0, "sched": None}
LOADS: dict[str, int] = {}  # request -> the step its asynchronous load began


class DeferringConnector(KVConnectorBase_V1):
    """Scheduler side only. Request "A" is answered None until step `defer_until` (its copies
    are on their way up), then a hit of all but its last block; "B*" get that hit at once,
    loaded asynchronously; others miss."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid, n = request.request_id, len(request.prompt_token_ids)
        hit = (n // BS - 1) * BS - num_computed_tokens
        if hit <= 0:  # (vLLM's own cache has it all)
            return 0, False
        if rid == "A":
            if STATE["step"] < STATE["defer_until"]:
                return None, False
            if STATE["guard"]:
                s = STATE["sched"]
                free = s.kv_cache_manager.block_pool.get_num_free_blocks() - s._inflight_prefill_reserved_blocks()
                if -(-n // BS) > free:
                    return None, False
            return hit, True
        if rid.startswith("B"):
            return hit, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            LOADS[request.request_id] = STATE["step"]

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    # the worker's half is not run here
    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    def wait_for_save(self): ...


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="the grid, with and without --guard")
    ap.add_argument("--model", required=True, help="a local model folder (its config only is read)")
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--blocks", type=int, default=41, help="GPU KV blocks (one is vLLM's null block)")
    ap.add_argument("--prompt-blocks", type=int, default=10)
    ap.add_argument("--loaders", type=int, default=3, help="requests B1.. behind A, each loading asynchronously")
    ap.add_argument("--defer-steps", type=int, default=3)
    ap.add_argument("--load-steps", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=300)
    a = ap.parse_args()
    import vllm.platforms as platforms
    if not platforms.current_platform.device_type:  # a GPU build on a machine without one: the scheduler needs none
        from vllm.platforms.cpu import CpuPlatform
        platforms._current_platform = CpuPlatform()
    if not a.sweep:
        print(json.dumps(run(a)))
        return
    totals = {False: [0, 0], True: [0, 0]}  # guard -> [runs, stalled]
    for blocks in (24, 28, 32, 36, 40):
        for loaders in (2, 3, 4):
            for defer in (1, 2, 4):
                for load in (1, 3):
                    for guard in (False, True):
                        r = run(argparse.Namespace(**{**vars(a), "blocks": blocks, "loaders": loaders,
                                                      "defer_steps": defer, "load_steps": load, "guard": guard}))
                        totals[guard][0] += 1
                        totals[guard][1] += r["stalled"]
                        print(json.dumps({"blocks": blocks, "loaders": loaders, "defer_steps": defer,
                                          "load_steps": load, **r}), flush=True)
    print("SUMMARY " + json.dumps({"vllm": vllm.__version__, **{("guard" if g else "no_guard"): {
        "runs": n, "stalled": k} for g, (n, k) in totals.items()}}))


def run(a) -> dict:
    LOADS.clear()
    STATE["guard"], STATE["defer_until"] = a.guard, a.defer_steps
    n = a.prompt_blocks * BS
    model = ModelConfig(model=a.model, dtype="float32", max_model_len=4 * n, seed=0, skip_tokenizer_init=True)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = a.blocks
    sched_cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4 * n, max_model_len=4 * n,
                                is_encoder_decoder=False)
    kvt = KVTransferConfig(kv_connector="DeferringConnector", kv_connector_module_path="__main__", kv_role="kv_both")
    cfg = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched_cfg, kv_transfer_config=kvt)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=model.dtype)
    kv_cfg = KVCacheConfig(num_blocks=a.blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kv_cfg, structured_output_manager=StructuredOutputManager(cfg),
                  block_size=BS, log_stats=False)
    STATE["sched"] = s
    from vllm.utils.hashing import sha256
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    rng = random.Random(0)
    ids = ["A"] + [f"B{i}" for i in range(1, a.loaders + 1)]
    for rid in ids:
        s.add_request(Request(rid, [rng.randrange(10, 1000) for _ in range(n)],
                              SamplingParams(max_tokens=2, ignore_eos=True), None, block_hasher=hasher))
    finished, idle, stalled = 0, 0, False
    for step in range(a.max_steps):
        STATE["step"] = step
        out = s.schedule()
        recv = {r for r, at in LOADS.items() if step - at >= a.load_steps}
        for r in recv:
            del LOADS[r]
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = s.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=KVConnectorOutput(finished_recving=recv))
        s.update_from_output(out, mro)
        finished = len(ids) - len(s.requests)
        if not s.has_requests():
            break
        idle = idle + 1 if not req_ids and not LOADS else 0
        if idle >= 50:
            stalled = True
            break
    return {"vllm": vllm.__version__, "guard": a.guard, "finished": finished, "requests": len(ids),
            "steps": step + 1, "stalled": stalled, "free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks()}


if __name__ == "__main__":
    main()

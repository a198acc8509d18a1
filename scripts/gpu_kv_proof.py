"""Every loaded byte, proven through the real engine: the blocks a hit fills against the blocks
the first prefill computed, byte for byte, on each load path.

vLLM's default mode (torch.compile + CUDA graphs, asynchronous scheduling, the engine core in
its own process) on the GPU; the CPU build runs the same script as a smoke run (`--tiny`). Each
case (a load path: `mapped`, `file`) runs in its own process, one engine, with the worker reached
through `LLM.collective_rpc`:

  weights re-seeded (seeded normal, std 0.02; embeddings 1; norms 1): tokens depend on the KV
  for each prompt length: a first prefill (stored); its chunks' blocks copied out (the
    reference); stores settled; vLLM's prefix cache reset and EVERY KV cache block overwritten
    with seeded noise, so a block the load does not write cannot pass; the hit; the hit's blocks
    compared with the reference, chunk by chunk and layer by layer; 16 greedy tokens against the
    first prefill's (a recompute)
  FULL graph: a decode batch joined by a hit with one token left (the step replays a FULL CUDA
    graph, no per-layer hooks), same comparisons
  damaged store, checksums on: a few stored segments flipped; the hit must fail exactly those
    chunks (vLLM recomputes from there) and still give the first prefill's tokens
  negative controls: the hit with its loads left out (the noise stays), and the store scrambled
    with `verify_checksums` off: both must give other tokens
  `tiered`: the same over `tiers` (a RAM tier of one prompt's chunks in front of a disk tier);
    before each hit a filler prompt of the same length pushes the prompt's chunks out of the RAM
    tier, so the hit loads from the disk tier (`tiers` in the results: the loads per tier)

    python3 scripts/gpu_kv_proof.py --out /tmp/kv_proof            # on the GPU machine
    python3 scripts/gpu_kv_proof.py --out /tmp/kv_proof --tiny     # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from subcase import emit, run_case as run_subcase  # noqa: E402
from vllm_ttft import make_model, prompt, run_joining  # noqa: E402

CHUNK = 256
# name: (tutti keys, vLLM engine keys). async_loads "auto" loads asynchronously where vLLM
# schedules asynchronously (its default mode); the layer-wise cases show why.
CASES = {
    "mapped": ({"mapped_loads": True}, {}),
    "file": ({"mapped_loads": False}, {}),
    "mapped_async": ({"mapped_loads": True, "async_loads": True}, {}),
    "mapped_layerwise": ({"mapped_loads": True, "async_loads": False}, {}),
    "mapped_layerwise_sync_sched": ({"mapped_loads": True, "async_loads": False}, {"async_scheduling": False}),
    "tiered": ({}, {}),  # `tiers` instead of `root` (run_case), hits from the disk tier
}


# ----------------------------------------------------------------------------- on the worker
# Each runs in the worker process (collective_rpc pickles it by value); `self` is vLLM's worker.
def _tutti(self):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def rpc_reseed(self, seed: int, recipe: str = "plain") -> int:
    """Seeded weights whose tokens depend on what attention reads: vLLM's dummy weights (uniform
    within 1e-3) give the same tokens whatever the cache holds. "plain": transformers' std 0.02,
    embeddings std 1, norms 1 (tokens stable across compute shapes). "sharp": attention's
    projections scaled as the demo's tiny Llama has them (q, k 2.26/sqrt(hidden), v, o
    5.66/sqrt(hidden)): tokens follow the KV more closely, but the argmax of a sharp attention
    then flips with the last bits of bf16 arithmetic, so the same KV computed in another batch
    shape (vLLM's own prefix cache too) gives other tokens; bytes are the proof there."""
    import math

    import torch

    model = self.model_runner.model
    hidden = self.vllm_config.model_config.get_hidden_size()
    # drawn where each weight lives, with a generator per device seeded alike: on the H200 a CPU
    # generator took most of a minute for an 8B model and longer than a load-or-compute phase's
    # time for the 70B-class layer; a seeded CUDA generator is as deterministic across processes
    gens: dict = {}
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                p.fill_(1.0)
                n += 1
                continue
            std = 0.02
            if "embed" in name:
                std = 1.0
            elif recipe == "sharp" and ("qkv_proj" in name or "q_proj" in name or "k_proj" in name):
                std = 2.26 / math.sqrt(hidden)
            elif recipe == "sharp" and ("o_proj" in name or "v_proj" in name):
                std = 5.66 / math.sqrt(hidden)
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.copy_((torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * std).to(p.dtype))
            n += 1
    return n


def rpc_install(self) -> dict:
    """Record every step's plan (loads, stores, whether the step ran per-layer hooks) and every
    load failure the pipeline reports."""
    import types

    w = _tutti(self)
    if getattr(w, "_probe", None) is None:
        w._probe = {"steps": [], "failed": [], "ref": {}, "tiers": {}}
        start = w.start_step

        def start_step(plan, *, layerwise=True):
            for ld in list(plan.loads) + list(plan.async_loads):
                w._probe["tiers"][ld.tier] = w._probe["tiers"].get(ld.tier, 0) + 1
            w._probe["steps"].append((plan.step, layerwise, [(ld.key, ld.slot, tuple(ld.block_ids), ld.skip_blocks,
                                                              ld.keep_blocks)
                                                             for ld in list(plan.loads) + list(plan.async_loads)],
                                      [(st.key, tuple(st.block_ids)) for st in plan.stores]))
            return start(plan, layerwise=layerwise)

        w.start_step = start_step
        pipelines = [w.loads] + ([w.async_loads.pipeline] if w.async_loads is not None else [])
        if w.async_loads is not None and w.async_loads.inline is not None:  # launched from the step's thread
            pipelines.append(w.async_loads.inline)
        for lp in pipelines:
            def _fail(self_, ld, why, _orig=lp.fail):
                w._probe["failed"].append((ld.key.hex()[:16], why[:120]))
                return _orig(ld, why)

            lp.fail = types.MethodType(_fail, lp)
    return {"maps": bool(w.loads.maps), "async_loads": w.async_loads is not None, "layers": w.ctx.num_layers, "seg": w.ctx.seg,
            "cuda": w.ctx.cuda, "kernel": w.kernel.name}


def rpc_tiers(self) -> dict:
    """Chunks loaded from each tier since the last call."""
    w = _tutti(self)
    out, w._probe["tiers"] = dict(w._probe["tiers"]), {}
    return {str(k): v for k, v in out.items()}


def _tiers(a, model: str, lengths: list[int]) -> list[dict]:
    """The `tiered` case's tiers: RAM (under --root) holding one prompt of the longest length
    and a little more, in front of a disk tier of --capacity (on /tmp)."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    slot = c["num_hidden_layers"] * heads * head_dim * 2 * (4 if a.tiny else 2) * CHUNK
    ram_chunks = max(lengths) // CHUNK + 2  # (the fillers before a hit push this many out)
    os.makedirs(a.root, exist_ok=True)
    disk = os.path.join("/tmp", os.path.basename(a.root) + "-disk")
    shutil.rmtree(disk, ignore_errors=True)
    return [{"root": os.path.join(a.root, "ram"), "capacity_bytes": ram_chunks * slot},
            {"root": disk, "capacity_bytes": a.capacity}]


def _gather(w, block_ids):
    """A chunk's blocks as canonical segments (L, S), by the torch reference (not the kernel under test)."""
    import torch

    from tutti.kernels import reference

    ctx = w.ctx
    out = torch.empty((ctx.num_layers, 1, ctx.seg), dtype=torch.uint8, device=ctx.device)
    ids = torch.tensor([list(block_ids)], dtype=torch.int64, device=ctx.device)
    reference.gather(ctx.caches, ctx.layout, ids, out, kernel_blocks_per_block=ctx.kbpb)
    return out[:, 0]


def rpc_reference(self) -> int:
    """Copy out the blocks of every chunk stored since the last call: what vLLM computed."""
    w = _tutti(self)
    w.flush()
    n = 0
    for _, _, _, stores in w._probe["steps"]:
        for key, blocks in stores:
            if key not in w._probe["ref"]:
                w._probe["ref"][key] = _gather(w, blocks).clone()
                n += 1
    w._probe["steps"] = []
    return n


def rpc_scramble(self, seed: int) -> float:
    """Every block of every layer overwritten with seeded noise: a normal 4x as wide as the KV the
    reference holds, so that keys the load failed to write win attention (noise narrower than
    the real keys would lose it to the computed tokens and change nothing). Returns its std."""
    import torch

    w = _tutti(self)
    w.flush()
    dtype = w.ctx.caches[0].dtype
    refs = list(w._probe["ref"].values())[:64]
    std = 1.0
    if refs and dtype.is_floating_point:
        vals = torch.cat([r[:, : w.ctx.seg - w.ctx.seg % 4096 or w.ctx.seg].contiguous().view(dtype).float().flatten()
                          for r in refs])
        std = max(float(vals.std()), 1e-3)
    g = torch.Generator(device=w.ctx.device).manual_seed(seed)
    for c in w.ctx.caches:
        if dtype.is_floating_point:
            c.copy_((torch.randn(c.shape, generator=g, device=c.device) * (4 * std)).to(dtype))
        else:
            c.copy_(torch.randint(0, 100, c.shape, generator=g, device=c.device, dtype=torch.int32).to(dtype))
    if w.ctx.cuda:
        torch.cuda.synchronize(w.ctx.device)
    w._probe["steps"], w._probe["failed"] = [], []
    return 4 * std


def rpc_compare(self, label: str = "") -> dict:
    """The blocks every load since the last scramble wrote, against the reference."""
    import torch

    w = _tutti(self)
    if w.ctx.cuda:
        torch.cuda.synchronize(w.ctx.device)
    failed = {k for k, _ in w._probe["failed"]}
    loads = [(step, lw, ld) for step, lw, lds, _ in w._probe["steps"] for ld in lds]
    w._probe.setdefault("loaded", {})[label] = [ld[0] for _, _, ld in loads]
    res = {"loads": len(loads), "failed": sorted(failed), "fail_reasons": w._probe["failed"][:8],
           "steps": [(s, lw, len(l), len(st)) for s, lw, l, st in w._probe["steps"] if l or st][:40],
           "equal": 0, "unequal": 0, "no_reference": 0, "mismatches": []}
    for step, lw, (key, slot, blocks, skip, keep) in loads:
        ref = w._probe["ref"].get(key)
        if ref is None:
            res["no_reference"] += 1
            continue
        got = _gather(w, blocks)
        # a tail hit (keep_blocks) wrote the tokens before its chunk's last block: those bytes only
        end = ref.shape[1] if keep is None else keep * (w.ctx.chunk_tokens // len(blocks)) * w.ctx.seg_token_bytes
        bad = [l for l in range(ref.shape[0]) if not torch.equal(got[l][:end], ref[l][:end])]
        res.setdefault("order", []).append((int(not bad), int(key.hex()[:16] in failed)))
        if not bad:
            res["equal"] += 1
            continue
        res["unequal"] += 1
        if len(res["mismatches"]) < 12:
            l = bad[0]
            diff = int((got[l] != ref[l]).sum())
            m = {"key": key.hex()[:16], "slot": slot, "step": step, "layerwise": lw, "skip": skip,
                 "failed": key.hex()[:16] in failed, "bad_layers": bad[:8], "n_bad_layers": len(bad),
                 "bytes_differing_first_bad_layer": diff, "of": int(ref.shape[1])}
            m.update(_where_bytes_differ(w, slot, l, ref[l]))
            res["mismatches"].append(m)
    return res


def _where_bytes_differ(w, slot: int, layer: int, ref) -> dict:
    """For a chunk whose blocks came out wrong: which copy of its stored bytes is right (the file
    through pread, the mapping read by the CPU, the mapping copied to the device)?"""
    import torch

    out = {}
    store, seg = w.ctx.store, w.ctx.seg
    try:
        fd, off = store.acquire(slot, layer)
        try:
            data = os.pread(fd, seg, off)
        finally:
            store.release(slot)
        out["file_equals_ref"] = torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ref.device), ref)
    except Exception as exc:  # noqa: BLE001
        out["file_error"] = repr(exc)[:200]
    try:
        view = store.mapped(slot, layer)
        if view is not None:
            out["mapping_cpu_equals_ref"] = torch.equal(view.clone().to(ref.device), ref)
            if w.ctx.cuda:
                dev = torch.empty(seg, dtype=torch.uint8, device=w.ctx.device)
                dev.copy_(view, non_blocking=True)
                torch.cuda.synchronize(w.ctx.device)
                out["mapping_dma_equals_ref"] = torch.equal(dev, ref)
    except Exception as exc:  # noqa: BLE001
        out["mapping_error"] = repr(exc)[:200]
    return out


def rpc_damage(self, label: str, n_chunks: int, layer: int) -> list[str]:
    """Flip the first 4 KiB of one layer's segment in `n_chunks` of the chunks the load `label`
    read (the 3rd, then every 7th), through the file: what a bad disk or another program would do.
    Every tier holding such a chunk gets the same damage, so the next load fails it wherever it
    reads it from (a tiered hit may come from the disk tier or from a copy promoted into RAM)."""
    w = _tutti(self)
    w.flush()
    wanted = set(w._probe["loaded"][label][2::7][:n_chunks])
    keys = set()
    for store, journal in [(w.ctx.store, w.journal), *w.ctx.lower]:
        for s, (key, _) in sorted(journal._entries.items()):
            if key not in wanted:
                continue
            fd, off = store.acquire(s, layer)
            # through a page-aligned buffer: a disk tier's files may be open with O_DIRECT
            try:
                with mmap.mmap(-1, 4096) as buf:
                    os.preadv(fd, [buf], off)
                    buf[:] = bytes(b ^ 0x5A for b in buf[:])
                    os.pwritev(fd, [buf], off)
            finally:
                store.release(s)
            keys.add(key.hex()[:16])
    return sorted(keys)


def rpc_scramble_store(self, keys_hex: list[str] | None = None) -> int:
    """Overwrite every stored chunk's first segment bytes with noise (the negative control with
    `verify_checksums` off)."""
    w = _tutti(self)
    w.flush()
    store, n = w.ctx.store, 0
    for s, (key, _) in sorted(w.journal._entries.items()):
        for layer in range(w.ctx.num_layers):
            fd, off = store.acquire(s, layer)
            try:
                os.pwrite(fd, os.urandom(w.ctx.seg), off)
            finally:
                store.release(s)
        n += 1
    return n


def rpc_set(self, what: str, value) -> bool:
    """Probe switches: 'verify' (checksums on/off), 'loads_off' (plans kept, nothing read or written)."""
    w = _tutti(self)
    if what == "verify":
        object.__setattr__(w.ctx.cfg, "verify_checksums", bool(value))
    elif what == "loads_off":
        if value:
            w.loads.start = lambda loads, *, layerwise: None
            w.loads.wait_layer = lambda layer: None
            w.loads.finish = lambda: None
            if w.async_loads is not None:  # received at once, nothing read or written
                w.async_loads._run = lambda *args, **kw: (set(), set())
                if w.async_loads.inline is not None:  # jobs launched from the step's thread: the same
                    from tutti.engine.worker.loads.detached import Detached

                    w.async_loads.inline.launch_detached = lambda loads: Detached(
                        loads=[], sums=[], bad_host=None, landed=None, started=None, pool_buffer=None, nbytes=0,
                        host_seconds=0.0, keys=set(), blocks=set())
        else:
            for name in ("start", "wait_layer", "finish"):
                w.loads.__dict__.pop(name, None)
            if w.async_loads is not None:
                w.async_loads.__dict__.pop("_run", None)
                if w.async_loads.inline is not None:
                    w.async_loads.inline.__dict__.pop("launch_detached", None)
    return True


# ----------------------------------------------------------------------------- one case
def run_case(case: str, a) -> dict:
    import torch

    from tutti.tools.demo import greedy, make_llm, on_cuda

    cuda = on_cuda()  # not torch.cuda.is_available(): the engine core is forked from this process
    # vLLM's default: the engine core in its own process (tutti's demo harness keeps it in-process)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("KV_PROOF_MULTIPROCESSING", "1")
    # the probes are functions sent to the worker process (cloudpickle); this process only
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    keys, engine_keys = CASES[case]
    # staging with room for every store of a step, so every chunk of a prompt is stored and hit
    # (the file path drains through write calls: room for a whole 32k prompt's 127 chunks)
    staging = ({"staging_bytes": "256MiB", "staging_slots": 256, "max_inflight_stores": 200} if a.tiny else
               {"staging_bytes": "6GiB", "staging_slots": 768, "max_inflight_stores": 704})
    # every hit loaded: this proves the load paths' bytes, not the hit policy's choices (on the
    # file path "auto" rightly recomputes once it has measured that reading is slower)
    extra = {"root": a.root, "capacity_bytes": a.capacity, "chunk_tokens": CHUNK, "hit_policy": "always",
             **staging, **keys}
    if case == "tiered":
        del extra["root"], extra["capacity_bytes"]
        extra["tiers"] = _tiers(a, a.model, a.lengths)
    kvt = {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    max_len = max(a.lengths) + CHUNK + 64
    kw = dict(skip_tokenizer_init=True, max_model_len=max_len, max_num_batched_tokens=a.batched_tokens,
              max_num_seqs=32, enforce_eager=False, load_format="auto" if a.tiny else "dummy")
    if cuda:
        kw.update(gpu_memory_utilization=0.6, dtype="bfloat16", block_size=16,
                  kernel_config={"enable_flashinfer_autotune": False, "enable_cutedsl_warmup": False})
    else:
        kw.update(block_size=32, dtype="float32", enforce_eager=True)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    kw.update(engine_keys)
    t0 = time.perf_counter()
    llm = make_llm(a.model, kv_transfer_config=kvt, **kw)
    eng = llm.llm_engine
    cfg = eng.vllm_config
    info = {"case": case, "start_s": round(time.perf_counter() - t0, 1),
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"}

    def rpc(fn, *args):
        return llm.collective_rpc(fn, args=args)[0]

    def progress(what: str) -> None:  # on stderr: a case that runs out of time says how far it got
        print(f"KVP_PROGRESS {time.perf_counter() - t0:.1f}s {what}", file=sys.stderr, flush=True)

    progress(f"engine started in {info['start_s']} s")

    def gen(ids, n=16):
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": ids}], greedy(n), use_tqdm=False)[0]
        return list(o.outputs[0].token_ids), o.num_cached_tokens or 0, time.perf_counter() - t

    resets = []

    def fresh(seed: int) -> None:
        """Stores settled, vLLM's prefix cache empty, every KV block noise."""
        rpc(rpc_reference)
        for _ in range(2):  # deliver the workers' reports (stores done, blocks freed) to the scheduler
            gen(prompt(999, 8, a.vocab), 1)
        resets.append(bool(llm.reset_prefix_cache()))
        rpc(rpc_scramble, seed)

    # On the GPU the dummy weights are re-seeded in place; the CPU build packs its linear weights at
    # load time (in-place changes never reach the matmuls), so the smoke run loads the demo's
    # seeded tiny Llama instead.
    info["reseeded"] = (f"{a.reseed}: {rpc(rpc_reseed, 1234, a.reseed)} tensors" if cuda
                        else "weights from tutti.tools.demo.make_tiny_model")
    info["worker"] = rpc(rpc_install)
    out = {}
    prompts = {}
    for n in a.lengths:
        p = prompts[n] = prompt(n, n, a.vocab)
        progress(f"hit_{n}: first prefill")
        toks, cached, dt = gen(p)
        rec = {"first": {"tokens": toks, "cached": cached, "s": round(dt, 3)}}
        if n == a.lengths[0]:  # the FULL-graph case's reference: vLLM's prefix cache over this very KV
            ref_join, _, _ = gen(p + [7])
        # vLLM's own prefix cache in the hit's shape: the prompt less its last block computed
        # first (a prompt of whole chunks gets a tail hit: all but its last block), then the prompt
        # (vLLM serves the front from its cache and computes the rest, as it will after tutti's
        # hit): what "a hit gives recompute's tokens" means for vLLM itself
        fresh(n + 1)
        block = kw["block_size"]
        gen(p[: n - block if n % CHUNK == 0 else (n - 1) // CHUNK * CHUNK], 1)
        toks_v, cached_v, _ = gen(p)
        rec["vllm_prefix_cache"] = {"tokens": toks_v, "cached": cached_v, "tokens_equal_first": toks_v == toks}
        progress(f"hit_{n}: vLLM's prefix cache in the hit's shape done; the hit")
        if case == "tiered":  # the prompt's chunks written down, then pushed out of the RAM tier
            for _ in range(4):
                gen(prompt(998, 8, a.vocab), 1)
            ram_chunks = max(a.lengths) // CHUNK + 2  # _tiers: the RAM tier's size
            for i in range(-(-ram_chunks // max(1, n // CHUNK))):
                gen(prompt(5000 + 10 * n + i, n, a.vocab), 1)
            for _ in range(4):
                gen(prompt(997, 8, a.vocab), 1)
            rpc(rpc_tiers)
        fresh(n)
        toks2, cached2, dt2 = gen(p)
        rec["hit"] = {"tokens_equal": toks2 == toks, "cached": cached2, "s": round(dt2, 3), "tokens": toks2,
                      "tokens_equal_vllm_prefix_cache": toks2 == toks_v}
        rec["tiers"] = rpc(rpc_tiers)  # chunks the hit loaded from each tier
        rec["blocks"] = rpc(rpc_compare, f"hit_{n}")
        out[f"hit_{n}"] = rec

    # FULL graph: decode requests running, then a hit whose last token is the only one to compute
    n0 = a.lengths[0]
    p_join = prompts[n0] + [7]
    progress("full-graph join")
    fresh(77)
    reqs = {f"d{i}": (prompt(100 + i, 100, a.vocab), 48) for i in range(6)}
    reqs["hit"] = (p_join, 16)
    res = run_joining(eng, reqs, {"hit": 4}, greedy)
    out["full_graph_join"] = {"tokens_equal": res.get("hit", {}).get("tokens") == ref_join,
                              "cached": res.get("hit", {}).get("cached"), "blocks": rpc(rpc_compare)}

    # damaged segments with checksums on: exactly those chunks fail, vLLM recomputes, tokens stay
    p = prompts[n0]
    ref_toks = out[f"hit_{n0}"]["first"]["tokens"]
    progress("damaged store")
    damaged = rpc(rpc_damage, f"hit_{n0}", 3, min(5, info["worker"]["layers"] - 1))
    fresh(5)
    toks, cached, dt = gen(p)
    cmp = rpc(rpc_compare)
    out["damaged_store"] = {"damaged": damaged, "failed": cmp["failed"],  # nothing damaged proves nothing
                            "exactly_those_failed": bool(damaged) and sorted(damaged) == sorted(cmp["failed"]),
                            "tokens_equal": toks == ref_toks,
                            "cached": cached, "s": round(dt, 3), "blocks": cmp, "tokens": toks,
                            "first_tokens": ref_toks}

    # negative controls: they must give other tokens, or the token checks above prove nothing
    n1 = a.lengths[-1]
    p, ref_toks = prompts[n1], out[f"hit_{n1}"]["first"]["tokens"]
    progress("controls")
    fresh(11)
    rpc(rpc_set, "loads_off", True)
    toks, cached, _ = gen(p)
    rpc(rpc_set, "loads_off", False)
    out["control_loads_left_out"] = {"tokens_differ": toks != ref_toks, "cached": cached}
    fresh(12)
    rpc(rpc_set, "verify", False)
    rpc(rpc_scramble_store)
    toks, cached, _ = gen(p)
    out["control_store_scrambled_verify_off"] = {"tokens_differ": toks != ref_toks, "cached": cached}
    info["results"] = out
    info["prefix_cache_resets_ok"] = resets
    return info


def summarize(r: dict) -> dict:
    res = r.get("results", {})
    s = {"case": r["case"], "cudagraph_mode": r.get("cudagraph_mode"), "async": r.get("async_scheduling"),
         "resets_ok": all(r.get("prefix_cache_resets_ok", [False]))}
    for name, v in res.items():
        b = v.get("blocks", {})
        s[name] = {k: v[k] for k in ("tokens_equal", "tokens_differ", "cached", "exactly_those_failed") if k in v}
        if "tiers" in v:
            s[name]["loads_by_tier"] = v["tiers"]
        if "hit" in v:
            s[name].update(tokens_equal=v["hit"]["tokens_equal"], cached=v["hit"]["cached"], hit_s=v["hit"]["s"],
                           first_s=v["first"]["s"],
                           tokens_equal_vllm_prefix_cache=v["hit"].get("tokens_equal_vllm_prefix_cache"),
                           vllm_prefix_cache_cached=v.get("vllm_prefix_cache", {}).get("cached"),
                           vllm_prefix_cache_equal_first=v.get("vllm_prefix_cache", {}).get("tokens_equal_first"))
        if b and b.get("failed"):
            order = b.get("order", [])
            first = next((i for i, (_, f) in enumerate(order) if f), len(order))
            s[name]["equal_before_first_failure"] = f"{sum(e for e, _ in order[:first])}/{first}"
        if b:
            s[name]["blocks"] = f"{b['equal']}/{b['loads']} chunks byte-equal, {b['unequal']} unequal, {len(b['failed'])} failed"
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="")
    ap.add_argument("--cases", default="mapped,file")
    ap.add_argument("--out", default="/tmp/kv_proof")
    ap.add_argument("--model", default="")
    ap.add_argument("--root", default="/dev/shm/tutti-kv-proof")
    ap.add_argument("--capacity", default="24GiB")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--reseed", default="plain", choices=["plain", "sharp"])
    ap.add_argument("--tiny", action="store_true", help="a small model and short prompts (the CPU smoke run)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.vocab = 4096 if a.tiny else 32000
    if a.case:
        emit(run_case(a.case, a))
        return
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        from tutti.tools.demo import make_tiny_model

        model = str(make_tiny_model(os.path.join(a.out, "tiny-model"), num_layers=4, vocab=a.vocab,
                                    max_position=max(a.lengths) + 1024))
    else:
        model = make_model(os.path.join(a.out, "model"), False)
    results, summary = {}, []
    for case in a.cases.split(","):
        root = f"{a.root}-{case}"
        shutil.rmtree(root, ignore_errors=True)
        cmd = [sys.executable, __file__, "--case", case, "--model", model, "--root", root, "--capacity", a.capacity,
               "--lengths", ",".join(map(str, a.lengths)), "--batched-tokens", str(a.batched_tokens),
               "--reseed", a.reseed]
        if a.tiny:
            cmd.append("--tiny")
        r, err = run_subcase(cmd, timeout=a_timeout(), tail=4000, progress="KVP_PROGRESS")
        r.setdefault("case", case)
        r["tutti_log"] = [l[-300:] for l in err.splitlines() if "tutti" in l][-30:]
        results[case] = r
        summary.append(summarize(r) if "error" not in r else {"case": case, "error": r["error"][-1500:]})
        print("KV_PROOF " + json.dumps(summary[-1]), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(a.out, "kv_proof.json"), "w") as f:
        json.dump({"summary": summary, "cases": results}, f, indent=1)


def a_timeout() -> int:
    return int(os.environ.get("KV_PROOF_CASE_TIMEOUT", "560"))


if __name__ == "__main__":
    main()

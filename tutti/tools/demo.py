"""`tutti demo`: serve a tiny local model with real vLLM twice over one store root.

Why two fresh processes: the second engine starts with an empty GPU/CPU prefix cache, so every
hit it reports came from tutti's files, and its tokens must equal the first engine's, which
computed everything. Each run is a child interpreter (`python -m tutti.tools.demo --child ...`) that
prints one JSON line; the parent only orchestrates and prints, so it never imports vLLM.

The model is generated here (a Llama config with random ``load_format="dummy"`` weights and a
word-level tokenizer): the demo needs no network and no download.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

# Environment vLLM needs here; set before vllm is imported anywhere.
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: the connector is reachable
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (CPU build only)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_COLOR": "0",  # plain log lines: a notebook's output shows no raw terminal colour codes
    "TOKENIZERS_PARALLELISM": "false",
}

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32

#: The demo's model: big enough that prefill costs clearly more than loading its KV.
DEMO_MODEL = dict(num_layers=4, hidden=512, num_heads=8, num_kv_heads=4, head_dim=64, vocab=512,
                  intermediate=1536)
DEMO_CHUNK_TOKENS = 128
WARMUP_SEED = 999


def set_env() -> None:
    """Apply ENV_DEFAULTS without overriding what the caller already set."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def make_tiny_model(
    dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 512,
    intermediate: int = 256,
    max_position: int = 4096,
    weights: bool = True,
) -> Path:
    """Write a Llama ``config.json``, a generated word-level tokenizer and (``weights``) seeded
    random weights.

    Token ``i`` is the word ``w{i}``; ids 0..3 are <unk>, <s>, </s>, <pad>. The weights make the
    tokens depend on the KV cache: vLLM's ``load_format="dummy"`` weights (uniform within 1e-3)
    leave attention so weak that a hit whose loads wrote nothing still gives recompute's tokens,
    which would make "tokens equal" prove nothing. Without ``weights``, load it with
    ``load_format="dummy"``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab < 8:
        raise ValueError(f"vocab={vocab} is too small; use vocab >= 8")
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(config, indent=1))
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + [f"w{i}" for i in range(len(specials), vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": max_position,
    }, indent=1))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}))
    if weights:
        _write_weights(d / "model.safetensors", num_layers=num_layers, hidden=hidden, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, vocab=vocab, intermediate=intermediate)
        # safetensors writes its file 0600 whatever the umask; give it the mode of its neighbours
        # (0644 under the usual umask 022), so another user or a container can load the model
        os.chmod(d / "model.safetensors", 0o666 & ~_umask())
    return d


def _umask() -> int:
    """The process's umask (reading it means setting it: put it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_weights(path: Path, *, num_layers: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   vocab: int, intermediate: int) -> None:
    """Seeded random Llama weights (std 0.02, as transformers initializes), with attention's value
    and output projections scaled up so that what attention reads (the KV cache) decides tokens."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1234)

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    t = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": w(num_heads * head_dim, hidden, std=0.2),
            p + "self_attn.k_proj.weight": w(num_kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.v_proj.weight": w(num_kv_heads * head_dim, hidden, std=0.5),
            p + "self_attn.o_proj.weight": w(hidden, num_heads * head_dim, std=0.5),
            p + "mlp.gate_proj.weight": w(intermediate, hidden), p + "mlp.up_proj.weight": w(intermediate, hidden),
            p + "mlp.down_proj.weight": w(hidden, intermediate),
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    save_file(t, str(path), metadata={"format": "pt"})


def kv_transfer_config(root: str | os.PathLike, *, chunk_tokens: int = DEMO_CHUNK_TOKENS,
                       capacity: str | int = "256MiB", **extra: Any) -> dict[str, Any]:
    """The kv_transfer_config that puts TuttiConnectorV1 over `root`."""
    cfg: dict[str, Any] = {"root": str(root), "capacity_bytes": capacity, "chunk_tokens": chunk_tokens}
    cfg.update(extra)
    return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


def on_cuda() -> bool:
    """Whether vLLM runs on CUDA, asked the way vLLM asks (NVML): `torch.cuda.is_available()`
    initialises CUDA in this process, and vLLM's engine core, forked from it, then cannot."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def make_llm(model_dir: str | os.PathLike, *, kv_transfer_config: dict[str, Any] | None = None, **kw: Any):
    """A ``vllm.LLM`` over a generated model, tuned to start fast (CPU build) or small (GPU)."""
    set_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    # vLLM keeps the worker-side connector in a process global that only a clean engine shutdown
    # clears; an engine that failed to start (a bad config) leaves it behind, and the next engine
    # in this process would silently reuse it.
    ensure_kv_transfer_shutdown()
    cuda = on_cuda()
    args: dict[str, Any] = dict(
        # the generated model's own weights where it has them (make_tiny_model), else vLLM's dummy ones
        model=str(model_dir), load_format="auto" if (Path(model_dir) / "model.safetensors").exists() else "dummy",
        dtype="bfloat16" if cuda else "float32",
        block_size=16 if cuda else BLOCK_SIZE, enforce_eager=True, seed=0, max_model_len=1024,
        max_num_seqs=8, max_num_batched_tokens=1024, enable_prefix_caching=True, disable_log_stats=True,
    )
    if cuda:
        args["gpu_memory_utilization"] = 0.3
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = (kv_transfer_config if isinstance(kv_transfer_config, KVTransferConfig)
                                      else KVTransferConfig(**kv_transfer_config))
    args.update(kw)
    return LLM(**args)


def greedy(max_tokens: int = 8):
    """Deterministic sampling: greedy, fixed length, no detokenizing."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def generate_ids(llm, prompts: Sequence[Sequence[int]], max_tokens: int = 8):
    """Run prompts given as token ids; return the RequestOutputs in order."""
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy(max_tokens), use_tqdm=False)


def connector_of(llm):
    """The scheduler-side TuttiConnectorV1 of an in-process engine (None without one)."""
    from tutti.vllm import internals

    try:
        return internals.engine_connector(llm)
    except AttributeError:
        return None


def settle(llm) -> None:
    """Let in-flight stores finish and reach the scheduler: flush the worker, then run one tiny
    step so its report is delivered (generate() returns before stores are durable)."""
    flush_worker()
    generate_ids(llm, [[5, 6, 7]], 1)


def flush_worker() -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        worker = getattr(get_kv_transfer_group(), "worker", None)
        if worker is not None:
            worker.flush()


def shutdown_llm(llm) -> None:
    """Stop an engine so a second one can start in the same process."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already shut down or a different client type
        pass
    del llm
    gc.collect()


def make_prompts(num: int, tokens: int, *, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """`num` distinct random prompts of `tokens` ids (ids 0..3 are special tokens)."""
    out = []
    for i in range(num):
        rng = random.Random(seed * 100003 + i)
        out.append([rng.randrange(4, vocab) for _ in range(tokens)])
    return out


# ---- one serving run (the child process) -------------------------------------------------------
def serve(model_dir: str, root: str, prompts: list[list[int]], *, chunk_tokens: int = DEMO_CHUNK_TOKENS,
          gen_tokens: int = 16) -> dict[str, Any]:
    """Start an engine with tutti over `root`, time the first token of each prompt (one at a
    time, max_tokens=1), then generate `gen_tokens` for all of them. Returns plain data."""
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts)
    max_len = max(1024, -(-(longest + gen_tokens + 1) // 256) * 256)
    llm = make_llm(model_dir, kv_transfer_config=kv_transfer_config(root, chunk_tokens=chunk_tokens),
                   max_model_len=max_len, max_num_batched_tokens=max_len)
    startup = time.perf_counter() - t0
    try:
        conn = connector_of(llm)
        # Warm-up on a prompt both runs share: the first run computes it, the second loads it,
        # so each run's own path is warm before the timed prompts.
        generate_ids(llm, make_prompts(1, len(prompts[0]), seed=WARMUP_SEED), 1)
        flush_worker()
        planner = conn.planner if conn is not None else None
        before = planner.stats.copy() if planner is not None else None  # count the timed prompts only
        rows = []
        for p in prompts:
            t = time.perf_counter()
            out = generate_ids(llm, [p], 1)[0]
            ttft = time.perf_counter() - t
            flush_worker()  # stores of this prompt finish before the next one is timed
            rows.append({"tokens": len(p), "ttft_s": ttft, "cached": int(out.num_cached_tokens or 0),
                         "first": list(out.outputs[0].token_ids)})
        outs = generate_ids(llm, prompts, gen_tokens)
        settle(llm)
        stats = planner.stats.since(before) if planner is not None else {}
        return {"startup_s": startup, "rows": rows, "generated": [list(o.outputs[0].token_ids) for o in outs],
                "stats": stats}
    finally:
        shutdown_llm(llm)


def _child_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tutti.tools.demo")
    ap.add_argument("--child", required=True, help="JSON job: model_dir, root, prompts, chunk_tokens")
    job = json.loads(ap.parse_args(argv).child)
    set_env()
    res = serve(job["model_dir"], job["root"], job["prompts"], chunk_tokens=job["chunk_tokens"])
    print("TUTTI_DEMO_RESULT " + json.dumps(res), flush=True)
    return 0


def run_child(job: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
    """Run `serve` in a fresh interpreter importing this copy of tutti."""
    pkg_parent = str(Path(__file__).resolve().parents[2])  # the folder that holds tutti/
    env = dict(os.environ)
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-m", "tutti.tools.demo", "--child", json.dumps(job)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=pkg_parent)
    lines = [l for l in p.stdout.splitlines() if l.startswith("TUTTI_DEMO_RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"demo engine process failed (exit status {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


# ---- the whole demo (the parent) ---------------------------------------------------------------
@dataclass
class DemoResult:
    root: str
    first: dict[str, Any]
    second: dict[str, Any]
    identical: bool
    hit_tokens: int
    prompt_tokens: int
    seconds: float
    lines: list[str] = field(default_factory=list)


def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f} ms"


def run_demo(*, root: str | None = None, keep: bool = False, prompt_tokens: int = 800, num_prompts: int = 4,
             chunk_tokens: int = DEMO_CHUNK_TOKENS, echo: Callable[[str], None] = print) -> DemoResult:
    """Serve `num_prompts` prompts twice over a fresh store root; print and return the outcome."""
    if not isinstance(prompt_tokens, int) or not chunk_tokens <= prompt_tokens <= 3800:
        raise ValueError(f"prompt_tokens={prompt_tokens!r}: expected an int in [{chunk_tokens}, 3800] "
                         f"(at least one chunk of {chunk_tokens} tokens, within the model's 4096 positions)")
    if not isinstance(num_prompts, int) or not 1 <= num_prompts <= 64:
        raise ValueError(f"num_prompts={num_prompts!r}: expected an int in [1, 64]")
    t_all = time.perf_counter()
    if root is not None:
        given = Path(root)
        if not given.parent.is_dir() or (given.exists() and not given.is_dir()):
            raise ValueError(f"--root {str(given)!r}: expected a new or empty directory whose parent exists")
        if given.exists() and any(given.iterdir()):
            raise ValueError(f"--root {str(given)!r}: not empty; the demo needs a fresh root (pass a new directory)")
    work = Path(tempfile.mkdtemp(prefix="tutti-demo-"))
    own_root = root is None
    store_root = Path(root) if root is not None else work / "store"
    lines: list[str] = []

    def say(s: str = "") -> None:
        lines.append(s)
        echo(s)

    try:
        model_dir = make_tiny_model(work / "model", **DEMO_MODEL)
        prompts = make_prompts(num_prompts, prompt_tokens)
        m = DEMO_MODEL
        say(f"tutti demo: Llama with {m['num_layers']} layers, hidden {m['hidden']}, {m['num_kv_heads']} KV heads "
            f"(random weights), {num_prompts} prompts of {prompt_tokens} tokens, chunks of {chunk_tokens} tokens")
        say(f"store root: {store_root}")
        job = {"model_dir": str(model_dir), "root": str(store_root), "prompts": prompts, "chunk_tokens": chunk_tokens}
        say("[1/2] fresh process, empty store: compute every prompt and store its KV ...")
        t = time.perf_counter()
        first = run_child(job)
        say(f"      done in {time.perf_counter() - t:.1f} s (engine start {first['startup_s']:.1f} s)")
        say("[2/2] fresh process, same store: load the prefixes from tutti ...")
        t = time.perf_counter()
        second = run_child(job)
        say(f"      done in {time.perf_counter() - t:.1f} s (engine start {second['startup_s']:.1f} s)")
        say()
        say(f"{'prompt':>6} {'tokens':>6} {'hit 1st':>9} {'hit 2nd':>9} {'TTFT compute':>13} {'TTFT tutti':>11} {'speedup':>7}")
        for i, (a, b) in enumerate(zip(first["rows"], second["rows"])):
            say(f"{i:>6} {a['tokens']:>6} {a['cached']:>9} {b['cached']:>9} {_ms(a['ttft_s']):>13} "
                f"{_ms(b['ttft_s']):>11} {a['ttft_s'] / max(b['ttft_s'], 1e-9):>6.2f}x")
        ta = statistics.median(r["ttft_s"] for r in first["rows"])
        tb = statistics.median(r["ttft_s"] for r in second["rows"])
        hit = sum(r["cached"] for r in second["rows"])
        total = sum(r["tokens"] for r in second["rows"])
        say(f"{'median':>6} {'':>6} {'':>9} {'':>9} {_ms(ta):>13} {_ms(tb):>11} {ta / max(tb, 1e-9):>6.2f}x")
        say()
        s1, s2 = first["stats"], second["stats"]
        say(f"hit tokens: {hit} of {total} prompt tokens in the second run (vLLM num_cached_tokens); planner: "
            f"hit_tokens={s2.get('hit_tokens')} loads_failed={s2.get('loads_failed')} "
            f"bytes_loaded={s2.get('bytes_loaded')} load_seconds={s2.get('load_seconds', 0.0):.3f}")
        say(f"stores: the first run committed {s1.get('stores_committed')} chunks ({s1.get('bytes_stored')} B), "
            f"the second {s2.get('stores_committed')}")
        identical = (first["generated"] == second["generated"]
                     and [r["first"] for r in first["rows"]] == [r["first"] for r in second["rows"]])
        say(f"identical tokens (second run from tutti vs first run computed): {'PASS' if identical else 'FAIL'}")
        say()
        from tutti.tools.storetools import inspect_lines

        for line in inspect_lines([str(store_root)]):
            say(line)
        seconds = time.perf_counter() - t_all
        say()
        say(f"demo took {seconds:.1f} s" + (f"; store kept at {store_root}" if keep or not own_root else ""))
        return DemoResult(str(store_root), first, second, identical, hit, total, seconds, lines)
    finally:
        if keep and own_root:
            shutil.rmtree(work / "model", ignore_errors=True)  # keep work/store
        else:
            shutil.rmtree(work, ignore_errors=True)  # the model (and our own temp root); never a given root


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

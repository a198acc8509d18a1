"""A real-vLLM CPU harness built on vLLM's public classes only.

Why: the connector tests need real engines (real scheduler, real attention
layers, real paged KV cache) that start in seconds on a 2-core CPU box with no
network. A tiny Llama with random (``load_format="dummy"``) weights and a
generated word-level tokenizer gives exactly that; weights are deterministic
because vLLM seeds the dummy loader from ``seed``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

# Environment vLLM needs here; set before vllm is imported anywhere.
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32


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
) -> Path:
    """Write a Llama ``config.json`` plus a generated word-level tokenizer.

    Token ``i`` is the word ``w{i}``; ids 0..3 are <unk>, <s>, </s>, <pad>.
    Load it with ``load_format="dummy"`` (no weight files are written).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

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
    return d


def make_llm(
    model_dir: str | os.PathLike,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    **kw: Any,
):
    """Start a ``vllm.LLM`` over ``model_dir`` tuned to start fast on this CPU.

    Keyword arguments override the defaults (dtype, max_model_len, seed, ...).
    """
    set_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(
        model=str(model_dir),
        load_format="dummy",
        dtype="float32",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = (
            kv_transfer_config if isinstance(kv_transfer_config, KVTransferConfig)
            else KVTransferConfig(**kv_transfer_config))
    args.update(kw)
    return LLM(**args)


def greedy(max_tokens: int = 8):
    """Deterministic sampling params: greedy, fixed length, no detokenizing."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False)


def generate_ids(llm, prompts: Sequence[Sequence[int]], max_tokens: int = 8):
    """Run prompts given as token ids; return the RequestOutputs in order."""
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                        greedy(max_tokens), use_tqdm=False)


def shutdown_llm(llm) -> None:
    """Stop an engine so a second one can start in the same process."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already shut down or a different client type
        pass
    del llm
    gc.collect()


def run_in_subprocess(code: str, *, env: dict[str, str] | None = None,
                      timeout: float = 300.0, cwd: str | None = None) -> str:
    """Run ``code`` in a fresh interpreter (a fresh engine over the same store).

    Returns stdout; raises with stderr's tail on failure. The repository root
    and tests folder are put on PYTHONPATH so the child imports this harness.
    """
    root = Path(__file__).resolve().parents[2]
    e = dict(os.environ)
    e.update(ENV_DEFAULTS)
    e["PYTHONPATH"] = os.pathsep.join(
        [str(root), str(root / "tests" / "vllm"), e.get("PYTHONPATH", "")])
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                       text=True, timeout=timeout, cwd=cwd or str(root))
    if p.returncode != 0:
        raise RuntimeError(f"subprocess failed rc={p.returncode}:\n{p.stderr[-6000:]}")
    return p.stdout


def settle(llm) -> None:
    """Let tutti's in-flight stores finish and reach the scheduler (generate() returns as soon
    as the tokens are out, while stores may still be writing): flush the worker, then run one
    tiny step so its report is delivered."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        worker = getattr(get_kv_transfer_group(), "worker", None)
        if worker is not None:
            worker.flush()
    generate_ids(llm, [[5, 6, 7]], 1)

"""A real-vLLM CPU harness built on vLLM's public classes only.

Why: the connector tests need real engines (real scheduler, real attention
layers, real paged KV cache) that start in seconds on a 2-core CPU box with no
network. A tiny Llama with random (``load_format="dummy"``) weights and a
generated word-level tokenizer gives exactly that; weights are deterministic
because vLLM seeds the dummy loader from ``seed``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

# The generated model and the environment live in the package (the demo needs them too).
# One harness: the demo's (tutti/tools/demo.py) engine, model and generation helpers.
from tutti.tools.demo import (  # noqa: E402,F401
    BLOCK_SIZE, ENV_DEFAULTS, flush_worker, generate_ids, greedy, make_llm, make_tiny_model, set_env, shutdown_llm,
)


def scheduler(llm):
    """The scheduler of an in-process engine (vLLM's private path lives in tutti.vllm.compat)."""
    from tutti.vllm import internals

    return internals.engine_scheduler(llm)


def connector(llm):
    """The scheduler-side connector of an in-process engine."""
    return scheduler(llm).connector


def generate_requests(llm, reqs: Sequence[dict], max_tokens: int = 8):
    """Run requests given as dicts: {"tokens": [...], "salt": str|None, "lora": (name, id, path)|None}."""
    from vllm.lora.request import LoRARequest

    prompts, loras = [], []
    for r in reqs:
        p: dict[str, Any] = {"prompt_token_ids": list(r["tokens"])}
        if r.get("salt"):
            p["cache_salt"] = r["salt"]
        prompts.append(p)
        loras.append(LoRARequest(*r["lora"]) if r.get("lora") else None)
    return llm.generate(prompts, greedy(max_tokens), lora_request=loras, use_tqdm=False)


def make_lora_adapter(dir: str | os.PathLike, *, seed: int, rank: int = 8, num_layers: int = 2, hidden: int = 128,
                      heads_dim: int = 256, kv_dim: int = 128, scale: float = 20.0) -> str:
    """A random rank-`rank` LoRA adapter (v_proj and o_proj of every layer) for the tiny Llama.
    Its weights are large next to the dummy weights (uniform in +-1e-3), so the adapter's
    output reaches the residual stream and changes the greedy tokens."""
    import torch
    from safetensors.torch import save_file

    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj, n_in, n_out in (("v_proj", hidden, kv_dim), ("o_proj", heads_dim, hidden)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * scale
            tensors[f"{base}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * scale
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["v_proj", "o_proj"], "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return str(d)


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
    import zygote

    # a fork of a process that imported vLLM (zygote.py), unless the phase sets its own environment
    p = zygote.run(code, cwd=cwd or str(root), timeout=timeout, env=e, fork=env is None)
    if p.returncode != 0:
        raise RuntimeError(f"subprocess failed rc={p.returncode}:\n{p.stderr[-6000:]}")
    return p.stdout


def settle(llm) -> None:
    """Let tutti's in-flight stores finish and reach the scheduler (generate() returns as soon
    as the tokens are out, while stores may still be writing): flush the worker, then run one
    tiny step so its report is delivered."""
    flush_worker()
    generate_ids(llm, [[5, 6, 7]], 1)


def kv_config(root: str | os.PathLike, *, chunk: int, capacity: Any, **extra: Any) -> dict:
    """A kv_transfer_config for TuttiConnectorV1 over `root` (failed loads recompute). Tests that
    assert which chunks are served load every hit (`hit_policy: always`); the load-or-compute
    policy (`auto`, the default for users) has its own tests that name it."""
    cfg = {"root": str(root), "capacity_bytes": capacity, "chunk_tokens": chunk, "hit_policy": "always"}
    cfg.update(extra)
    return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


def prompt(seed: int, n: int) -> list[int]:
    """`n` reproducible random token ids of the tiny model's vocabulary (ids 0..3 are special)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]

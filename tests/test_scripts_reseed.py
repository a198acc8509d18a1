"""scripts/gpu_kv_proof.py's re-seeding of a model's weights (the GPU benchmarks' token evidence):
the same seed gives the same weights in another process, norms are 1, matrices std 0.02."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_kv_proof  # noqa: E402


def fake_worker(seed_init: int):
    torch.manual_seed(seed_init)  # different starting weights: the re-seed must not depend on them
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(64, 32), "q_proj": torch.nn.Linear(32, 32),
                                 "input_layernorm": torch.nn.LayerNorm(32)}).to(torch.bfloat16)
    cfg = SimpleNamespace(model_config=SimpleNamespace(get_hidden_size=lambda: 32))
    return SimpleNamespace(model_runner=SimpleNamespace(model=model), vllm_config=cfg)


def test_the_same_seed_gives_the_same_weights_whatever_they_were():
    a, b = fake_worker(1), fake_worker(2)
    assert gpu_kv_proof.rpc_reseed(a, 1234) == gpu_kv_proof.rpc_reseed(b, 1234) == 5
    pa, pb = dict(a.model_runner.model.named_parameters()), dict(b.model_runner.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert torch.all(pa["input_layernorm.weight"] == 1) and torch.all(pa["input_layernorm.bias"] == 1)
    assert 0.015 < pa["q_proj.weight"].float().std().item() < 0.025
    assert 0.8 < pa["embed_tokens.weight"].float().std().item() < 1.2
    c = fake_worker(1)
    gpu_kv_proof.rpc_reseed(c, 99)
    assert not torch.equal(dict(c.model_runner.model.named_parameters())["q_proj.weight"], pa["q_proj.weight"])

"""Multimodal identity on a real vLLM engine: the same text with a different image must not hit.

tutti keys a chunk by a hash chain over token ids plus identity bytes taken from vLLM's own
per-block extra keys (``generate_block_hash_extra_keys``: multimodal identifiers and offsets among
them). A PaliGemma prompt's image becomes placeholder tokens whose ids are the same for every
image, so the token ids of (text, red image) and (text, blue image) are identical: only the
identity keeps their KV apart. This test proves it end to end with a tiny random PaliGemma on the
CPU build: red is stored by one engine; a fresh engine (vLLM's own prefix cache off) must then
compute blue from scratch and load red from tutti, each giving the tokens of a run without tutti.

The model is generated here: a PaliGemma config (one-layer SigLIP tower at 28x28 with 14x14
patches, so 4 image tokens; a two-layer Gemma with head_dim 64), a word-level tokenizer with an
``<image>`` token, a SigLIP preprocessor config and seeded random weights written as safetensors.
Real weights rather than ``load_format="dummy"``: the dummy loader's +-1e-3 values (LayerNorm
scales included) shrink the image's features to nothing, so red and blue would give the same
tokens and the test could not fail; weights with sane scales and an untied LM head make the
image change the output.

vLLM's PaliGemma imports its Pixtral module (for the vision-encoder lookup), which imports
transformers' Pixtral image processor, which imports torchvision; the CPU test environment has no
torchvision, so that one module is replaced by a stub in this process and in every child.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import harness

CHUNK = 64  # tokens a chunk: 2 vLLM blocks of 32
TEXT = " ".join(f"w{i}" for i in range(10, 160))  # 150 words; with the image: 156 prompt tokens
RED, BLUE = (255, 0, 0), (0, 0, 255)
IMAGE_TOKENS = 4  # (28 // 14) ** 2

# Runs in this process and first thing in every child (before vLLM resolves PaliGemma's vision
# encoder). Only where torchvision is missing: with it, the real module imports fine.
PIXTRAL_STUB = '''
import importlib.util as _iu, sys as _sys, types as _types
if _iu.find_spec("torchvision") is None and "vllm.model_executor.models.pixtral" not in _sys.modules:
    from transformers.models.pixtral.configuration_pixtral import PixtralVisionConfig as _PVC
    _m = _types.ModuleType("vllm.model_executor.models.pixtral")
    _m.__doc__ = "test stub: the real module imports torchvision through transformers' Pixtral"
    _m.PixtralVisionConfig = _PVC  # get_vision_encoder_info only isinstance-checks it

    class _NoPixtral:
        def __init__(self, *a, **k):
            raise ImportError("vllm.model_executor.models.pixtral is stubbed: no torchvision here")

    _m.PixtralHFEncoderInfo = _m.PixtralHFVisionModel = _NoPixtral
    _sys.modules[_m.__name__] = _m
'''


def stub_pixtral() -> None:
    exec(PIXTRAL_STUB, {"__name__": "pixtral_stub"})


# ------------------------------------------------------------------ the tiny PaliGemma
def make_tiny_paligemma(d: Path, *, vocab: int = 512, std: float = 0.1) -> Path:
    import torch
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]  # ids 0..4
    words = specials + ["\n"] + [f"w{i}" for i in range(len(specials) + 1, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken("\n", normalized=False)])  # vLLM's PaliGemma ends every prompt with it
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "PaliGemmaProcessor",
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096}))
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor", "processor_class": "PaliGemmaProcessor",
        "size": {"height": 28, "width": 28}, "image_seq_length": IMAGE_TOKENS, "resample": 3,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "PaliGemmaProcessor"}))
    text = {"model_type": "gemma", "vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32"}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "projection_dim": 128, "num_image_tokens": IMAGE_TOKENS, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps({
        "architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma",
        "image_token_index": 4, "hidden_size": 128, "projection_dim": 128, "vocab_size": vocab,
        "tie_word_embeddings": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "torch_dtype": "float32", "text_config": text, "vision_config": vision}, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))

    # Seeded weights under the checkpoint names vLLM's PaliGemma loads.
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}

    def rand(name, *shape):
        sd[name] = torch.randn(*shape, generator=g) * std

    def const(name, value, *shape):
        sd[name] = torch.full(shape, float(value))

    vp = "vision_tower.vision_model."
    H, P, VI = vision["hidden_size"], vision["patch_size"], vision["intermediate_size"]
    rand(vp + "embeddings.patch_embedding.weight", H, 3, P, P)
    const(vp + "embeddings.patch_embedding.bias", 0, H)
    rand(vp + "embeddings.position_embedding.weight", IMAGE_TOKENS, H)
    for i in range(vision["num_hidden_layers"]):
        p = f"{vp}encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            const(p + ln + ".weight", 1, H)
            const(p + ln + ".bias", 0, H)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            rand(p + f"self_attn.{proj}.weight", H, H)
            const(p + f"self_attn.{proj}.bias", 0, H)
        rand(p + "mlp.fc1.weight", VI, H)
        const(p + "mlp.fc1.bias", 0, VI)
        rand(p + "mlp.fc2.weight", H, VI)
        const(p + "mlp.fc2.bias", 0, H)
    const(vp + "post_layernorm.weight", 1, H)
    const(vp + "post_layernorm.bias", 0, H)
    D, hd, I = text["hidden_size"], text["head_dim"], text["intermediate_size"]
    nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    rand("multi_modal_projector.linear.weight", D, H)
    const("multi_modal_projector.linear.bias", 0, D)
    lp = "language_model.model."
    rand(lp + "embed_tokens.weight", vocab, D)
    for i in range(text["num_hidden_layers"]):
        p = f"{lp}layers.{i}."
        const(p + "input_layernorm.weight", 0, D)  # Gemma's RMSNorm scales by (1 + weight)
        const(p + "post_attention_layernorm.weight", 0, D)
        rand(p + "self_attn.q_proj.weight", nh * hd, D)
        rand(p + "self_attn.k_proj.weight", nkv * hd, D)
        rand(p + "self_attn.v_proj.weight", nkv * hd, D)
        rand(p + "self_attn.o_proj.weight", D, nh * hd)
        rand(p + "mlp.gate_proj.weight", I, D)
        rand(p + "mlp.up_proj.weight", I, D)
        rand(p + "mlp.down_proj.weight", D, I)
    const(lp + "norm.weight", 0, D)
    rand("language_model.lm_head.weight", vocab, D)  # untied: tied, a random model echoes its input
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


# ------------------------------------------------------------------ engines
LLM_KW = dict(load_format="auto", enable_prefix_caching=False, limit_mm_per_prompt={"image": 1})

# Defines run(color) -> (result, planner stats) in a child that has an engine `llm`.
CHILD_HELPERS = '''
import json, harness
from PIL import Image

def run(color, max_tokens=8):
    req = {"prompt": TEXT, "multi_modal_data": {"image": Image.new("RGB", (28, 28), tuple(color))}}
    out = llm.generate([req], harness.greedy(max_tokens), use_tqdm=False)[0]
    harness.settle(llm)  # stores are durable and reported before the stats are read
    stats = dict(vars(harness.connector(llm).planner.stats))
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "prompt_len": len(out.prompt_token_ids)}, stats
'''


def child(model_dir: Path, kvt: dict, colors: list) -> list:
    """A fresh process with tutti on: each color's request in turn, with the stats after it."""
    code = (PIXTRAL_STUB + f"TEXT = {TEXT!r}\n" + CHILD_HELPERS
            + f"llm = harness.make_llm({str(model_dir)!r}, kv_transfer_config={kvt!r}, **{LLM_KW!r})\n"
            + f"print('RESULT', json.dumps([run(c) for c in {colors!r}]))\n"
            + "harness.shutdown_llm(llm)\n")
    out = harness.run_in_subprocess(code)
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])


def reference(model_dir: Path, colors: list) -> list[list[int]]:
    """Tokens without any connector, in this process, one request at a time."""
    from PIL import Image

    stub_pixtral()
    llm = harness.make_llm(model_dir, **LLM_KW)
    try:
        return [list(llm.generate([{"prompt": TEXT, "multi_modal_data": {"image": Image.new("RGB", (28, 28), c)}}],
                                  harness.greedy(8), use_tqdm=False)[0].outputs[0].token_ids)
                for c in colors]
    finally:
        harness.shutdown_llm(llm)


def test_same_text_different_image_does_not_hit(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("PIL")
    model = make_tiny_paligemma(tmp_path / "tiny-paligemma")
    want_red, want_blue = reference(model, [RED, BLUE])
    assert want_red != want_blue, "the image does not change the output: this test could not fail"

    kvt = harness.kv_config(tmp_path / "kv", chunk=CHUNK, capacity="64MiB")
    [(first, s1)] = child(model, kvt, [RED])
    n = first["prompt_len"]
    assert n == IMAGE_TOKENS + 1 + 150 + 1  # <image>x4 <bos> text \n
    full = n // CHUNK * CHUNK  # whole chunks of the prompt: 128 of 156
    assert first["cached"] == 0 and s1["hit_tokens"] == 0
    assert s1["stores_committed"] == full // CHUNK and s1.get("unkeyed_requests", 0) == 0, s1
    assert first["tokens"] == want_red

    # A fresh engine over the same store, vLLM's prefix cache off: every hit is tutti's.
    [(blue, s2), (red, s3)] = child(model, kvt, [BLUE, RED])
    # blue: identical token ids, different image: nothing may come from red's chunks
    assert blue["prompt_len"] == n
    assert blue["cached"] == 0 and s2["hit_tokens"] == 0, (blue, s2)
    assert s2["stores_committed"] == full // CHUNK, s2  # stored as chunks of its own
    assert blue["tokens"] == want_blue
    # red again: its chunks from phase 1 are served, and give the reference tokens
    assert red["cached"] == full and s3["hit_tokens"] == full, (red, s3)
    assert s3["loads_failed"] == 0 and s3.get("unkeyed_requests", 0) == 0, s3
    assert red["tokens"] == want_red

"""What a chunk's identity takes from vLLM beyond token ids: the model's weights behind its
name, a LoRA adapter's content, and vLLM's own per-block extra keys (LoRA, multimodal inputs,
cache salt, prompt embeddings), so a hit means what vLLM's prefix cache means."""

from __future__ import annotations

import functools
from typing import Any

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model")


_SAMPLE_PAGES, _PAGE = 16, 4096


def _file_identity(path: str) -> bytes:
    """Size plus a hash of the first 64 KiB (a safetensors header: names, shapes, offsets) and of
    16 pages spread over the file. Cheap on a 100 GB checkpoint, stable across copies, and a
    retrained or re-quantised checkpoint differs in every sampled page."""
    import hashlib
    import os

    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        for i in range(_SAMPLE_PAGES):
            f.seek(max(0, (size - _PAGE) * i // max(1, _SAMPLE_PAGES - 1)))
            h.update(f.read(_PAGE))
    return h.digest()


def model_identity(vllm_config: Any) -> str:
    """What the model's name does not say about its KV values: the weights and config behind it.

    A checkpoint replaced under the same path (a fine-tune, a new revision) keeps every shape,
    so without this its old chunks would be served as if they were still right.
    """
    import hashlib
    import os

    mc, lc = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    load_format = str(getattr(lc, "load_format", "auto"))
    h = hashlib.sha256()
    for part in (load_format, getattr(mc, "quantization", None), getattr(mc, "hf_overrides", None),
                 getattr(mc, "revision", None)):
        h.update(repr(part).encode() + b"\0")
    path = str(mc.model)
    if not os.path.isdir(path):  # a hub id: the cached snapshot directory is named by its commit
        try:
            from huggingface_hub import try_to_load_from_cache

            cfg = try_to_load_from_cache(path, "config.json", revision=getattr(mc, "revision", None))
            if isinstance(cfg, str):
                path = os.path.dirname(cfg)
        except Exception:  # noqa: BLE001 - no hub client: name and revision only
            pass
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and name.endswith(_WEIGHT_SUFFIXES) and ("dummy" not in load_format
                                                                             or name.endswith(".json")):
                h.update(name.encode() + b"\0" + _file_identity(full))
    return h.hexdigest()[:16]


def _extra_keys_fn():
    """vLLM's own per-block extra keys (LoRA, multimodal identifiers and offsets, cache salt,
    prompt-embedding hashes): the same function vLLM's block hash uses, on 0.26 and 0.32+, so a
    field vLLM adds there becomes part of tutti's keys too."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys


@functools.lru_cache(maxsize=256)
def _adapter_identity(path: str, signature: tuple) -> bytes:
    """Content identity of a LoRA adapter directory (its files' sizes and sampled pages): an
    adapter replaced under the same name and path gets new keys."""
    import hashlib
    import os

    h = hashlib.sha256()
    for name, _ in signature:
        h.update(name.encode() + b"\0" + _file_identity(os.path.join(path, name)))
    return h.digest()


def lora_identity(lora_request: Any) -> bytes:
    if lora_request is None:
        return b""
    import os

    path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
    if not os.path.isdir(path):
        return b""  # a hub id or a remote path: vLLM's extra keys (name, path) are the identity
    try:
        sig = tuple(sorted((n, os.stat(os.path.join(path, n)).st_mtime_ns) for n in os.listdir(path)
                           if os.path.isfile(os.path.join(path, n))))
        return _adapter_identity(path, sig)
    except OSError:
        return b""


def request_identity(request: Any, hash_block_size: int):
    """identity(start, end) -> bytes for tutti's chunk keys: vLLM's extra keys of every vLLM
    block in [start, end), plus the LoRA adapter's content identity. None for a request with
    none of them (token ids alone say what its KV is)."""
    from tutti.engine.keys import canonical

    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or getattr(request, "mm_hashes", None)
    if not (lora or mm or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        return None
    extra_keys = _extra_keys_fn()
    adapter = lora_identity(lora)

    def identity(start: int, end: int) -> bytes:
        parts: list[Any] = [adapter]
        for b in range(start, end, hash_block_size):
            keys, _ = extra_keys(request, b, b + hash_block_size, 0)
            parts.append(keys)
        return canonical(parts)

    return identity


def prompt_tokens(request: Any) -> list[int]:
    toks = getattr(request, "prompt_token_ids", None)
    return list(toks) if toks is not None else []

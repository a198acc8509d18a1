"""Fixtures for tests that run a real vLLM engine on the CPU (see harness.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # import harness, recording_connector

import harness  # noqa: E402

harness.set_env()  # before anything imports vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (4 heads, 2 KV heads, head_dim 64) with a generated tokenizer."""
    pytest.importorskip("vllm")
    return harness.make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))

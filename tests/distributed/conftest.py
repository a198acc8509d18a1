"""Fixtures for the tests on a real distributed file system: a GlusterFS volume brought up on
this machine (gluster.py) with two FUSE mounts standing in for two nodes, and the real-vLLM
harness (tests/vllm/harness.py) for the engines that share it.

Skipped, with the reason, only where FUSE, root or the GlusterFS packages are missing; where the
environment variable CI is set (a CI run, which installs them through scripts/setup.sh) a
missing prerequisite fails the tests instead, and so does a volume that does not come up."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))  # harness.py, phases.py, zygote.py
sys.path.insert(0, str(HERE))  # gluster.py

import gluster  # noqa: E402
import harness  # noqa: E402

harness.set_env()  # before anything imports vllm


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A running GlusterFS volume and its mounts: `cluster.mounts["a"]`, `cluster.mounts["b"]`.
    Tests share it: each works under a directory of its own on the volume."""
    lack = gluster.missing()
    if lack:
        msg = "GlusterFS cannot be brought up here: missing " + "; ".join(lack)
        if _in_ci():
            pytest.fail(msg + " (CI is set: scripts/setup.sh should have installed it)", pytrace=False)
        pytest.skip(msg)
    # a short base path: the brick paths name the daemons' sockets and logs
    c = gluster.Cluster(tmp_path_factory.mktemp("gl", numbered=True))
    t0 = time.perf_counter()
    c.start()
    print(f"\nGlusterFS up in {time.perf_counter() - t0:.1f} s: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in c.bringup_s.items()), file=sys.stderr)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def on_volume(cluster, request):
    """A fresh directory for this test on the volume: (path through node a, path through node b)."""
    name = "t-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:80]
    a, b = cluster.mounts["a"] / name, cluster.mounts["b"] / name
    a.mkdir()
    return a, b


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (2 KV heads, head_dim 64) with a generated tokenizer (tests/vllm/harness.py)."""
    pytest.importorskip("vllm")
    return harness.make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))

"""bench/swap_kernel_compare.py on the CPU: vLLM's own Triton swap kernel (vLLM 0.33's and 0.34's
swap_blocks_triton.py, loaded by file path, nothing else of vLLM imported) moves the same bytes as
tutti's gather/scatter on every layout both handle, through Triton's interpreter."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "swap_kernel_compare.py")


def _site_for(version: str):
    spec = importlib.util.spec_from_file_location("tutti_bench_swap_kernel_compare", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.site_for(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_vllm_swap_kernel_moves_the_same_bytes_as_tutti(tmp_path, version):
    site = _site_for(version)
    if site is None:
        tag = version[2:4]
        pytest.skip(f"vLLM {version}'s code not extracted here (bash scripts/check_vllm_0{tag}.sh extracts it; "
                    f".ci/run sets TUTTI_VLLM0{tag}_SITE)")
    out = tmp_path / "swap.json"
    p = subprocess.run([sys.executable, BENCH, "--site", site, "--out", str(out)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(out))
    assert d["ok"] and d["speed"] is None, d.get("speed_note")  # interpreted: correctness only
    (entry,) = d["sites"].values()
    assert entry["vllm_imported"] is False  # the kernel's file alone, its two vllm imports answered by stand-ins
    assert (entry["NUM_SMS"], entry["THRESHOLD_BYTES"], entry["MIN_N"]) == (12, 28 * 1024, 16)
    rows = {(r["layout"], r["dtype"]): r for r in entry["checks"]}
    compared = [r for r in rows.values() if r["both"]]
    # token-major blocks (NHD K|V, MLA, block-outer shared and cross-layer buffers) are compared ...
    assert {r["kind"] for r in compared} == {"nhd", "shared_int8_block_outer", "shared_int8_scales", "shared_int8_odd",
                                             "mla3", "mla4", "cross_layer_block_outer"}
    for r in compared:
        assert r["gather_equal"] and r["scatter_equal"] and r["scatter_changed_cache"], r
        assert r["control_detected"], r  # two blocks exchanged in vLLM's descriptors: told apart
        assert r["vllm_left_padding"] and r["tutti_zeroed_padding"], r
    # ... pages whose size is not a power of two, and pages over vLLM's 8 KiB chunk, among them
    assert rows[("mla3", "bf16")]["padding_bytes"] > 0
    assert rows[("mla_576_bf16", "bf16")]["page_bytes"] == 18432 and rows[("mla_576_bf16", "bf16")]["ok"]
    assert rows[("nhd_h8d128_bf16", "bf16")]["vllm_would_run"].startswith("DMA")
    assert rows[("nhd_h1d128_bf16", "bf16")]["vllm_would_run"].startswith("triton (8192-byte chunks")
    # ... and the layouts whose block is several runs are named with the reason
    for kind in ("hnd", "kv_outer", "kv_inner", "shared_int8", "cross_layer_layer_outer"):
        assert not rows[(kind, "bf16")]["both"] and rows[(kind, "bf16")]["why"]

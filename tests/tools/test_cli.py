"""The `tutti` command on real stores: written by the real worker pipeline (real files, real IO
queue, real kernels), and once by real vLLM engines through `tutti demo`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tutti.tools import cli
from tutti.engine.plan import StepPlan, StoreChunk
from tutti.engine.build import Geometry, build_worker
from tutti.store.fingerprint import Fingerprint
from tutti.store.chunk_store import ChunkStore, list_namespaces
from tutti.kernels import PagedLayout

REPO = Path(__file__).resolve().parents[2]
L, B, H, N, D = 3, 24, 2, 16, 8  # layers, blocks, kv heads, tokens/block, head size
T = 32  # chunk tokens: 2 blocks
SLOTS = {3: [0, 1], 7: [4, 5], 8: [10, 11]}


def geometry() -> Geometry:
    return Geometry(model="tiny-cli", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L,
                    num_heads=H, content_bytes=2 * D * 4)


def make_store(root: Path, writer_id: str = "") -> Path:
    """Store three chunks of random KV through the real WorkerPipeline."""
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(B, H, N, 2 * D, generator=g) for _ in range(L)]
    views = [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]
    layout = PagedLayout.from_tensor(views[0], ("block", "head", "kv", "token", "dim"))
    cfg = {"root": str(root), "capacity_bytes": 64 * geometry().slot_bytes, "chunk_tokens": T,
           "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8, "lookahead": 1,
           "writer_id": writer_id}
    w = build_worker(cfg, geometry(), caches=views, layout=layout)
    stores = [StoreChunk("r", bytes([i + 1]) * 32, slot, tuple(blocks), ticket=i + 1)
              for i, (slot, blocks) in enumerate(SLOTS.items())]
    w.start_step(StepPlan(1, stores=stores))
    for layer in range(L):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()
    w.flush()
    rep = w.take_report()
    w.close()
    assert sorted(rep.stored) == [1, 2, 3] and not rep.store_failed
    return root


@pytest.fixture
def store_root(tmp_path) -> Path:
    return make_store(tmp_path / "kv")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def segment_location(root: Path, slot: int, layer: int) -> tuple[str, int]:
    fp = Fingerprint.from_dict(list_namespaces(str(root))[0].manifest["fingerprint"])
    with ChunkStore(str(root), fp, capacity_bytes=64 * geometry().slot_bytes, writer=False) as st:
        _, off = st.location(slot, layer)
        return st.slab_path(slot), off


def flip_byte(path, off: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ mask]))


# ---- inspect ------------------------------------------------------------------------------------
def test_inspect_shows_fingerprint_chunks_slabs_and_journal(store_root, capsys):
    rc, out, _ = run_cli(capsys, "inspect", str(store_root))
    assert rc == 0
    digest = geometry().fingerprint().digest()
    assert f"namespace {digest}" in out
    assert "model tiny-cli" in out and "dtype float32" in out and f"chunk {T} tokens" in out
    assert f"layers {L}" in out and f"H {H}" in out and f"C {2 * D * 4} B" in out and "tp 0/1" in out
    assert "chunks 3 x" in out and "slab-0.bin: 3/64 slots used" in out
    assert "journal" in out and "pass --capacity" in out


def test_inspect_json_and_capacity(store_root, capsys):
    cap = 64 * geometry().slot_bytes
    rc, out, _ = run_cli(capsys, "inspect", "--json", "--capacity", str(cap), str(store_root))
    assert rc == 0
    (ns,) = json.loads(out)
    g = geometry()
    assert ns["chunks"] == 3 and ns["bytes_used"] == 3 * g.slot_bytes and ns["capacity_bytes"] == cap
    assert ns["fingerprint"]["num_layers"] == L and ns["fingerprint"]["segment_bytes"] == g.segment_bytes
    assert sum(s["slots_used"] for s in ns["slabs"]) == 3
    # slot 8 is the highest: the slab is at least 9 slots long
    assert ns["slabs"][0]["size_bytes"] >= 9 * g.slot_bytes and ns["journal_bytes"] > 0
    rc, out, _ = run_cli(capsys, "inspect", "--capacity", "64MiB", str(store_root))
    assert rc == 0 and re.search(r"of 64\.0 MiB capacity \(\d+\.\d%\)", out)


# ---- verify -------------------------------------------------------------------------------------
def test_verify_clean_store(store_root, capsys):
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 0, out
    assert out.startswith(f"OK: {3 * L} segments in 3 chunks of 1 namespace(s)")


def test_verify_catches_a_flipped_byte(store_root, capsys):
    path, off = segment_location(store_root, 7, 1)
    flip_byte(path, off + 100, 0x01)
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 1
    assert "FAILED: 1 bad segment(s) in 3 chunk(s)" in out
    assert re.search(r"slot 7 layer 1: checksum mismatch: journal 0x[0-9a-f]{16}, data 0x[0-9a-f]{16}", out)
    assert "slot 3" not in out and "slot 8" not in out


def test_verify_catches_a_truncated_slab(store_root, capsys):
    path, off = segment_location(store_root, 8, 2)
    os.truncate(path, off + 10)  # slot 8's last layer cut short
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 1 and "slot 8 layer 2: short read" in out and "slot 8 layer 0" not in out


def test_verify_swapped_segments_are_caught(store_root, capsys):
    # two whole, internally valid segments in each other's place: only the journal can tell
    p1, o1 = segment_location(store_root, 3, 0)
    p2, o2 = segment_location(store_root, 3, 2)
    seg = geometry().segment_bytes
    with open(p1, "r+b") as f:
        f.seek(o1)
        a = f.read(seg)
        f.seek(o2)
        b = f.read(seg)
        f.seek(o1)
        f.write(b)
        f.seek(o2)
        f.write(a)
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 1 and "slot 3 layer 0" in out and "slot 3 layer 2" in out and "slot 3 layer 1" not in out


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_missing_root_and_not_a_root_exit_2(tmp_path, capsys, cmd):
    rc, out, err = run_cli(capsys, cmd, str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err and not out
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, cmd, str(tmp_path / "empty"))
    assert rc == 2 and "is not a tutti store root" in err
    (tmp_path / "file").write_text("x")
    rc, _, err = run_cli(capsys, cmd, str(tmp_path / "file"))
    assert rc == 2 and "is not a directory" in err


def test_damaged_manifest_is_reported(store_root, capsys):
    ns = list_namespaces(str(store_root))[0]
    Path(ns.path, "manifest.json").write_text("{not json")
    rc, out, _ = run_cli(capsys, "inspect", str(store_root))
    assert rc == 0 and "ERROR:" in out and "not valid JSON" in out
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 1 and "namespace cannot be opened" in out


def test_wrong_number_of_roots(store_root, tmp_path, capsys):
    other = tmp_path / "second"
    other.mkdir()
    # a usage error, not a failed check: exit status 2, the reason on stderr
    rc, out, err = run_cli(capsys, "verify", "--no-progress", str(store_root), str(other))
    assert rc == 2 and "striped over 1 roots" in err and "FAILED" not in out


def test_entry_point_usage_errors():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "tutti"], capture_output=True, text=True, env=env, cwd=REPO)
    assert p.returncode == 2 and "demo" in p.stderr and "verify" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tutti", "inspect", "/nonexistent/tutti"], capture_output=True,
                       text=True, env=env, cwd=REPO)
    assert p.returncode == 2 and "tutti: error: store root '/nonexistent/tutti' does not exist" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tutti", "inspect", "--capacity", "lots", "/tmp"],
                       capture_output=True, text=True, env=env, cwd=REPO)
    assert p.returncode == 2 and "--capacity" in p.stderr


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "demo", "--prompt-tokens", "5")
    assert rc == 2 and "prompt_tokens=5" in err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    rc, _, err = run_cli(capsys, "demo", "--root", str(tmp_path / "used"))
    assert rc == 2 and "not empty" in err
    rc, _, err = run_cli(capsys, "demo", "--root", str(tmp_path / "no" / "parent"))
    assert rc == 2 and "parent exists" in err


# ---- bench --------------------------------------------------------------------------------------
def test_bench_options_after_the_kind_are_tuttis_and_pytests_come_after_two_dashes():
    """As the README writes it: `tutti bench io --full --no-compare -- -k store` (an argparse
    REMAINDER used to hand --full and --no-compare to pytest)."""
    ap = cli.build_parser()
    args = cli.parse_cli(ap, ["bench", "io", "--full", "--no-compare", "--", "-k", "store", "--", "x"])
    assert (args.kind, args.full, args.no_compare, args.pytest_args) == ("io", True, True, ["-k", "store", "--", "x"])
    args = cli.parse_cli(ap, ["bench", "policy"])
    assert (args.kind, args.full, args.no_compare, args.pytest_args) == ("policy", False, False, [])
    with pytest.raises(SystemExit):
        cli.parse_cli(ap, ["bench", "io", "-k", "store"])  # pytest's arguments only after '--'


def test_bench_command_saves_and_compares(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "repo_root", lambda: tmp_path)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "test_io_bench.py").write_text("")
    monkeypatch.delenv("TUTTI_IO_BENCH_BYTES", raising=False)
    cmd, env = cli.bench_command("io")
    assert "--benchmark-only" in cmd and "--benchmark-autosave" in cmd
    assert not any(a.startswith("--benchmark-compare") for a in cmd)
    assert env["TUTTI_IO_BENCH_BYTES"] == str(64 << 20)
    saved = tmp_path / ".benchmarks" / "Linux-CPython-3.11-64bit"
    saved.mkdir(parents=True)
    (saved / "0001_abc_20250101_000000.json").write_text(json.dumps(
        {"benchmarks": [{"fullname": "bench/test_kernels_bench.py::test_x"}]}))
    cmd, _ = cli.bench_command("io")
    assert not any(a.startswith("--benchmark-compare") for a in cmd)  # a run of the other suite
    (saved / "0002_abc_20250101_000001.json").write_text(json.dumps(
        {"benchmarks": [{"fullname": "bench/test_io_bench.py::test_io_store_load"}]}))
    cmd, _ = cli.bench_command("io", extra=["-k", "store"])
    assert "--benchmark-compare=0002" in cmd and cmd[-2:] == ["-k", "store"]
    cmd, env = cli.bench_command("io", full=True, compare=False)
    assert "TUTTI_IO_BENCH_BYTES" not in env and not any(a.startswith("--benchmark-compare") for a in cmd)
    with pytest.raises(cli.CliError, match="test_kernels_bench.py"):
        cli.bench_command("kernels")


# ---- the demo, end to end on real vLLM ------------------------------------------------------------
def test_demo_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    root = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "tutti", "demo", "--root", str(root), "--num-prompts", "2",
                        "--prompt-tokens", "544"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "identical tokens (second run from tutti vs first run computed): PASS" in p.stdout
    hit = int(re.search(r"hit tokens: (\d+) of (\d+)", p.stdout).group(1))
    assert hit == 2 * 512  # 4 whole chunks of 128 tokens per prompt; the 32-token tail is computed
    assert re.search(r"planner: hit_tokens=1024 loads_failed=0", p.stdout)
    assert "chunks 12 x" in p.stdout  # 2 prompts x 4 chunks + the warm-up prompt's 4
    # the store a real engine wrote checks out, segment by segment
    v = subprocess.run([sys.executable, "-m", "tutti", "verify", "--no-progress", str(root)],
                       capture_output=True, text=True, env=env, cwd=REPO)
    assert v.returncode == 0 and v.stdout.startswith("OK:"), v.stdout + v.stderr


def test_inspect_and_verify_read_every_writer_of_a_shared_namespace(tmp_path, capsys):
    """Servers sharing a root (writer ids) each have a `w-<id>/` directory: both tools read all of
    them, and a flipped byte in one writer's slab is found in that writer's files."""
    root = make_store(tmp_path / "kv", "a")
    make_store(root, "b")
    rc, out, _ = run_cli(capsys, "inspect", "--json", str(root))
    assert rc == 0
    nss = json.loads(out)
    assert sorted(os.path.basename(ns["path"]) for ns in nss) == ["w-a", "w-b"] and all(ns["chunks"] == 3 for ns in nss)
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(root))
    assert rc == 0 and out.startswith(f"OK: {2 * 3 * L} segments in 6 chunks of 2 namespace(s)"), out
    fp = geometry().fingerprint()
    with ChunkStore(str(root), fp, capacity_bytes=64 * geometry().slot_bytes, writer=False, writer_id="b") as st:
        path, off = st.slab_path(7), st.location(7, 1)[1]
    flip_byte(path, off + 5, 0x01)
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(root))
    assert rc == 1 and "w-b" in out and "slot 7" in out, out


def test_tutti_serve_stops_on_a_bad_tutti_config_before_vllm_starts(tmp_path):
    """A misspelt key stops `tutti serve` before it hands over to vLLM (which would load the model
    first): exit status 2, tutti's message naming the key and the nearest one as the last line, and
    no store created. Another connector's config is vLLM's to check."""
    ktc = {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {"root": str(tmp_path / "kv"), "capacity_byte": "1GiB"}}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "tutti", "serve", str(tmp_path / "no-model"), "--kv-transfer-config",
                        json.dumps(ktc)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("tutti: error: kv_connector_extra_config: unknown key(s) ['capacity_byte']")
    assert "did you mean 'capacity_bytes'" in last
    assert not (tmp_path / "kv").exists()
    from tutti.tools.cli import check_kv_transfer_config

    check_kv_transfer_config(["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector",
                                                                  "kv_connector_extra_config": {"x": 1}})])


def test_tutti_serve_leaves_out_vllms_advice_to_run_vllm_serve(tmp_path):
    """vLLM's server module warns it is deprecated and advises `vllm serve`, which the CPU build
    cannot run; `tutti serve` runs that module without the advice (vLLM's own errors still show)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "tutti", "serve", str(tmp_path / "no-model"), "--port", "1"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode != 0 and p.stderr.strip(), p.stderr[-2000:]  # no model there: vLLM says so
    assert "Please use `vllm server`" not in p.stderr and "is deprecated" not in p.stderr, p.stderr[-2000:]

"""Bad configuration values and unusable roots: a clear error at start-up (the engine never
serves a request), naming the key or path, and nothing written to the disk."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import harness
from relkit import engine, failed_start_cleanup, kv_config, prompt

AREA = "bad configuration / roots"


def _files(path):
    return sorted(str(p) for p in path.rglob("*")) if path.exists() else None


def start_fails(tiny_model, kvt: dict, match: str, watch=None) -> str:
    """Start an engine with `kvt`; it must raise (matching `match`) and leave `watch` as it was."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    before = _files(watch) if watch is not None else None
    try:
        with pytest.raises(Exception, match=match) as ei:
            with engine(tiny_model, kvt):
                pass
        # the refused engine must not leave its connector as vLLM's process-global one: the next
        # engine in this process would reuse it, with this bad configuration
        assert not has_kv_transfer_group(), "a refused start left vLLM's global connector set"
    finally:
        failed_start_cleanup()
    if watch is not None:
        assert _files(watch) == before, f"a refused start wrote to the disk: {_files(watch)}"
    return str(ei.value)


def test_bad_values_fail_before_any_request_or_io(tiny_model, tmp_path, report):
    from tutti.engine.config.settings import EngineConfig

    root = tmp_path / "kv"  # never created: a refused start must not create it
    ok = {"root": str(root), "capacity_bytes": "16MiB"}
    # validated without an engine: the dict vLLM hands over
    pure = [
        ({**ok, "chunk_tokns": 64}, "unknown key"),
        ({"capacity_bytes": "1GiB"}, "root"),
        ({"root": str(root)}, "capacity_bytes: missing"),
        ({**ok, "capacity_bytes": "lots"}, "capacity_bytes='lots'"),
        ({**ok, "capacity_bytes": -5}, "capacity_bytes=-5"),
        ({**ok, "capacity_bytes": True}, "capacity_bytes=True"),
        ({**ok, "chunk_tokens": 0}, r"chunk_tokens=0"),
        ({**ok, "chunk_tokens": True}, r"chunk_tokens=True"),
        ({**ok, "chunk_tokens": "64"}, r"chunk_tokens='64'"),
        ({**ok, "lookahead": 0}, r"lookahead=0"),
        ({**ok, "io_backend": "spdk"}, "io_backend"),
        ({**ok, "verify_checksums": "yes"}, "verify_checksums"),
        ({**ok, "staging_slots": 1}, "staging_slots=1"),
        ({**ok, "max_inflight_stores": 64}, "max_inflight_stores=64"),  # leaves no slot of 64 for loads
        ({"roots": [], "capacity_bytes": "1GiB"}, "roots=\\[\\]"),
        ({**ok, "roots": ["/a"]}, "either 'root' or 'roots'"),
        ({"roots": [str(root), 3], "capacity_bytes": "1GiB"}, "roots="),
    ]
    for raw, match in pure:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_dict(raw)
    # through a real engine start
    engine_cases = [
        ({"chunk_tokens": 48}, r"kv_connector_extra_config\.chunk_tokens=48: must be a multiple of the KV cache's block_size"),
        ({"capacity_bytes": 4096}, "capacity_bytes=4096"),
        ({"staging_bytes": "64KiB"}, "staging_bytes"),
        ({"chunk_tokns": 32}, "unknown key"),
        ({"lookahead": 99}, "lookahead=99"),
        ({"io_backend": "spdk"}, "io_backend"),
    ]
    messages = []
    for extra, match in engine_cases:
        messages.append(start_fails(tiny_model, kv_config(root, **extra), match, watch=tmp_path))
    assert not root.exists()

    # unusable roots
    afile = tmp_path / "afile"
    afile.write_text("x")
    roots = [
        (afile, "exists but is not a directory"),  # a file where the directory should be
        (afile / "kv", "not a directory"),  # a path under a file
        (tmp_path / "missing" / "deeper" / "kv", "does not exist"),  # missing parent
    ]
    for r, match in roots:
        messages.append(start_fails(tiny_model, kv_config(r), match, watch=tmp_path))
    skipped = []
    ro = tmp_path / "ro"
    ro.mkdir()
    m = (subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,ro", "tmpfs", str(ro)], capture_output=True, text=True)
         if shutil.which("mount") else subprocess.CompletedProcess([], 1, "", "no mount(8)"))
    if m.returncode == 0:
        try:
            messages.append(start_fails(tiny_model, kv_config(ro), "read-only filesystem"))
        finally:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    else:
        skipped.append(f"read-only root (mount refused: {m.stderr.strip()})")

    # a damaged manifest in an existing namespace: refused, never overwritten
    good = tmp_path / "good"
    with engine(tiny_model, kv_config(good)) as llm:
        harness.generate_ids(llm, [prompt(1, 70)], 2)
    manifest = next(good.glob("tutti-*/manifest.json"))
    manifest.write_text("{ not json")
    messages.append(start_fails(tiny_model, kv_config(good), "manifest .* is not valid JSON", watch=good))
    assert manifest.read_text() == "{ not json"

    bad_inputs = len(pure) + len(messages)
    report.tried = (f"{len(pure)} bad extra-config values (parser), {len(engine_cases)} through engine start "
                    "(chunk not a block multiple, capacity < 1 chunk, staging < 1 segment, typo key, lookahead, "
                    "backend), root: a file / under a file / missing parent / read-only mount, damaged manifest")
    report.held = ("every one refused while the engine starts (LLM() raises, no request served) with an error "
                   "naming the key or path; nothing written to the disk; the damaged manifest left for inspection"
                   + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
                   + "; permission bits not tried: the suite runs as root, which ignores them")
    report.bad_inputs = bad_inputs
    report.requests = 1
    report.counts = {"refused_at_start": len(messages), "refused_by_parser": len(pure)}

"""Hostile store files on a real server: a namespace planted by another user in a shared root is
refused at start (nothing written through it, its planted lock target untouched); with a secret,
chunks forged by someone who can write the store (new bytes with matching unkeyed checksums)
fail their keyed tags and are recomputed, while honest chunks are still served."""

from __future__ import annotations

import os

import pytest
import torch

import harness
from relkit import CHUNK, connector_of, engine, failed_start_cleanup, kv_config, prompt, reference, stats, tokens

AREA = "hostile files"
OTHER_UID = 4242
PROMPT_LEN = 4 * CHUNK + 5


def test_planted_namespace_refused_and_forged_chunks_recomputed(tiny_model, tmp_path, report, monkeypatch):
    from tutti.store.fingerprint import Fingerprint
    from tutti.store.chunk_store import ChunkStore, list_namespaces
    from tutti.kernels import segment_checksum

    report.tried = ("(1) another uid pre-creates the namespace in a sticky world-writable root, mode 0777, with "
                    "LOCK -> a victim file; a server starts there; (2) with secret_env set, a server stores 2 "
                    "prompts, then one chunk's bytes are replaced and re-journaled with matching unkeyed "
                    "checksums (what anyone able to write the files could do); a fresh server asks both again")
    # (1) a planted namespace: found only once a first server created the fingerprint's directory name
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    probe = tmp_path / "probe"
    with engine(tiny_model, kv_config(probe)):
        pass
    ns_name = os.path.basename(list_namespaces(str(probe))[0].path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = shared / ns_name
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.symlink(victim, planted / "LOCK")
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(Exception, match="namespace .*refused"):
        harness.make_llm(tiny_model, kv_transfer_config=kv_config(shared))
    failed_start_cleanup()
    assert victim.read_bytes() == b"precious" and os.listdir(planted) == ["LOCK"]

    # (2) forged chunks under a secret
    monkeypatch.setenv("TUTTI_REL_SECRET", "reliability-suite-secret-0123456789")
    kvt = kv_config(tmp_path / "kv", secret_env="TUTTI_REL_SECRET", slots_per_slab=8)
    p1, p2 = prompt(901, PROMPT_LEN), prompt(902, PROMPT_LEN)
    want = reference(tiny_model, [p1, p2], 4)
    with engine(tiny_model, kvt) as llm:
        for p in (p1, p2):  # one at a time: p2's chunks take slots 4..7
            harness.generate_ids(llm, [p], 4)
            harness.settle(llm)
    info = list_namespaces(str(tmp_path / "kv"))[0]
    assert ("integrity", "blake2b-mac-64-bound") in [tuple(x) for x in info.manifest["fingerprint"]["extra"]]
    fp = Fingerprint.from_dict(info.manifest["fingerprint"])
    slot_bytes, seg = info.manifest["slot_bytes"], info.manifest["segment_bytes"]
    st = ChunkStore(str(tmp_path / "kv"), fp, capacity_bytes=16 << 20, writer=True)
    forged_slot = 5  # a chunk of p2
    key = st.entries()[forged_slot].key
    fd, off = st.location(forged_slot, 0)
    data = bytearray(os.pread(fd, slot_bytes, off))
    data[seg:2 * seg] = bytes(reversed(data[seg:2 * seg]))  # other KV in layer 1
    os.pwrite(fd, bytes(data), off)
    sums = segment_checksum(torch.frombuffer(data, dtype=torch.uint8).view(-1, seg)).tolist()
    st.record_put(key, forged_slot, [int(v) & ((1 << 64) - 1) for v in sums])
    st.sync_data()
    st.sync_journal()
    st.close()
    with engine(tiny_model, kvt, enable_prefix_caching=False) as llm:
        got = tokens(harness.generate_ids(llm, [p1, p2], 4))
        s = stats(llm)
        conn = connector_of(llm)
        assert conn is not None
    assert got == want
    assert s["loads_failed"] == 1 and s["hit_tokens"] >= 5 * CHUNK  # p1 whole, p2 up to the forged chunk
    report.held = ("(1) the server refused to start, naming the namespace (foreign owner, writable by others); the "
                   "planted LOCK's target untouched, nothing created through the namespace; (2) the forged chunk "
                   "failed its keyed tag before anything was scattered and was recomputed; honest chunks still "
                   "served; outputs == recompute")
    report.requests = 2 + 2 + 2
    report.faults = 1
    report.bad_inputs = 1
    report.bytes_lost = 0
    report.counts = {"loads_failed": s["loads_failed"], "hit_tokens": s["hit_tokens"]}

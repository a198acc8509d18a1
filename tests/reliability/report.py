"""The reliability report: tests append what they tried and what held; a final step renders
docs/reliability.md from it.

Why generated: a table typed by hand says what someone hoped; this one says what the last full
run of tests/reliability actually did (requests served, faults injected, bytes lost), including
any test that failed.

Usage from tests: the ``report`` fixture (conftest.py) hands out a `Row` to fill in. The
session end writes ``<results>.json`` and, when every test of the folder ran, docs/reliability.md.
By hand: ``python3 tests/reliability/report.py RESULTS.json [OUT.md]``; after scripts/test.sh's
parallel run, ``python3 tests/reliability/report.py build/reliability.json.gw*``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
#: Where rows go; override with TUTTI_RELIABILITY_JSON. build/ is ignored by git.
DEFAULT_JSON = ROOT / "build" / "reliability.json"


@dataclass
class Row:
    """One test's line in the table."""

    test: str  # pytest node id
    area: str  # crash, disk full, corruption, ...
    tried: str = ""  # what was done to the store
    held: str = ""  # what was checked and held
    requests: int = 0  # requests served (outputs compared with recompute)
    faults: int = 0  # faults injected (kills, corruptions, ENOSPC episodes, ...)
    bad_inputs: int = 0  # bad configurations / roots tried
    bytes_lost: int | None = None  # durable bytes not hit by a fault that could no longer be served
    counts: dict[str, Any] = field(default_factory=dict)  # hits, stores, evictions, failures...
    outcome: str = "not run"  # passed / failed / skipped (set by the conftest hook)
    reason: str = ""  # skip reason or failure summary
    seconds: float = 0.0


def load(path: str | os.PathLike) -> tuple[list[dict], str]:
    """(rows, environment line) of a results file."""
    p = Path(path)
    if not p.exists():
        return [], ""
    data = json.loads(p.read_text())
    return data["rows"], data.get("env", "")


def save(path: str | os.PathLike, rows: list[Row], env: str = "") -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {"written": time.strftime("%Y-%m-%d %H:%M:%S"), "env": env, "rows": [asdict(r) for r in rows]}
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(p)


def _fmt_counts(c: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items()) if c else ""


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], *, env: str = "") -> str:
    """The markdown of docs/reliability.md."""
    out = [
        "# Reliability",
        "",
        "The promises a storage tier must keep, each checked by a test in `tests/reliability/` that",
        "could fail, on a real vLLM CPU engine with real files. **This file is written by the test",
        "suite** (`python3 -m pytest tests/reliability`, or `bash scripts/test.sh` with the rest):",
        "every row is what the last full run tried and observed, not what we hoped.",
        "",
        "Outputs are always compared token for token with the same prompts through an engine without",
        "the connector (recompute). *Bytes lost* counts durable stored bytes, not hit by the fault",
        "itself, that could no longer be served afterwards.",
        "",
        "| Area | What was tried | What held | Requests | Faults | Bad inputs | Bytes lost | Counts | Result | s |",
        "|---|---|---|---:|---:|---:|---:|---|---|---:|",
    ]
    tot = {"requests": 0, "faults": 0, "bad_inputs": 0, "bytes_lost": 0, "seconds": 0.0}
    outcomes: dict[str, int] = {}
    for r in rows:
        lost = "" if r.get("bytes_lost") is None else r["bytes_lost"]
        res = r["outcome"] + (f": {r['reason']}" if r.get("reason") else "")
        out.append("| " + " | ".join(_cell(x) for x in (
            r["area"], r["tried"], r["held"], r["requests"], r["faults"], r["bad_inputs"], lost,
            _fmt_counts(r.get("counts") or {}), res, f"{r['seconds']:.0f}")) + " |")
        for k in ("requests", "faults", "bad_inputs", "seconds"):
            tot[k] += r.get(k) or 0
        tot["bytes_lost"] += r.get("bytes_lost") or 0
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
    out.append(f"| **Total** | {len(rows)} tests | {summary} | {tot['requests']} | {tot['faults']} | "
               f"{tot['bad_inputs']} | {tot['bytes_lost']} | | | {tot['seconds']:.0f} |")
    out += ["", f"Last full run: {env}" if env else "", "", *ROUND_THREE, "", *ROUND_TWO, "", *LIMITS, ""]
    return "\n".join(out)


#: The third audit's findings (#48), each with the test that fails without its fix, or the reason it is open.
ROUND_THREE = [
    "## Audit: an attacker sharing the store root, and faults (a full tmpfs, checks off, the share group)",
    "",
    "| # | Finding | Status | Test (fails without the fix) |",
    "|---|---|---|---|",
    "| 1 | High: a full tmpfs killed the server with SIGBUS: a writer on a RAM root mapped its whole capacity over "
    "sparse slabs, so once /dev/shm filled (another process, or two replicas with one config that both saw the "
    "space free) the next copy into an unbacked page faulted; the same with `mapped_loads: true` on a disk | fixed: "
    "a writer reserves every byte of a slab (`posix_fallocate`) before it maps it writable; a slab the file system "
    "cannot reserve stays unmapped and its stores take the file path, where a full disk fails one store with ENOSPC; "
    "a close on a full disk no longer raises (the records it could not journal are misses) | "
    "tests/reliability/test_disk_full.py::test_a_ram_root_crowded_out_after_start_never_faults_the_server, "
    "tests/reliability/test_disk_full.py::test_two_replicas_with_one_config_on_one_small_tmpfs_never_fault |",
    "| 2 | High: with `verify_checksums: false` on the namespace's writer (`''`, explicit or the first `auto`), "
    "another writer's chunks were loaded unchecked: a chunk its owner rewrote mid-step (or a stale follower map "
    "after inode reuse) served another prompt's KV | fixed: the flag trusts this writer's own chunks only; a "
    "step that loads any chunk of another writer verifies it whatever the flag says | "
    "tests/engine/test_sharing.py::test_another_writers_chunk_rewritten_mid_step_is_never_served_even_with_"
    "checksums_off |",
    "| 3 | Med: the namespace directory is 2770 without the sticky bit, so a member renamed `w-a/` away and "
    "planted her own (`a` then wrote into it); holding the group-writable `''` LOCK and 63 planted `w-auto-N` "
    "stopped every `auto` server (\"all 64 writer slots are held\") | fixed: a named writer uses its directory "
    "only if it owns it, and refuses naming the owner's uid (`WriterDirectoryTakenError`); an `auto` server passes "
    "over slots whose directory another member owns without counting them (up to 4,096 names). Left by design: "
    "no sticky bit on the namespace directory, since `''` is a role members take in turns and renames its files "
    "(journal compaction), which a sticky directory forbids across owners; a renamed directory is a denial of "
    "service, never wrong KV (keyed tags) | tests/store/test_store_sharing.py::test_a_member_cannot_make_a_named_"
    "writer_write_into_her_directory, tests/store/test_store_sharing.py::test_planted_auto_slots_never_stop_an_"
    "auto_server |",
    "| 4 | Med (a regression of item 2b below): a named writer that created a shared root made it 2750, and every "
    "other member's server refused to start | fixed: the root is created with the namespace's (group-writable) "
    "mode | tests/store/test_store_sharing.py::test_a_named_writer_that_creates_the_root_leaves_it_to_the_group |",
    "| 5 | Med: another writer's `extras.jsonl` cost every follower ~11x its size in RAM and stalled the "
    "scheduler up to 1.1 s while parsed | fixed: one poll reads at most 1 MiB; lines are kept for chunks their "
    "writer holds, and at most 65,536 for chunks not journaled yet; the writer's own start-up reads its file in "
    "the same steps, keeping only its live chunks' lines | tests/engine/test_sharing.py::test_another_writers_huge_"
    "extras_never_grow_a_followers_memory_past_its_bound, tests/store/test_extras.py::test_a_huge_extras_file_is_"
    "read_in_bounded_steps_and_a_restart_still_reads_it_all |",
    "| 6 | Med: a deeply nested line in the server's own `extras.jsonl` stopped it from starting (RecursionError) "
    "| fixed: such a line is skipped like any hostile line | tests/store/test_extras.py::test_a_deeply_nested_line_"
    "in_a_writers_own_extras_never_stops_its_start |",
    "| 7 | Med: empty `w-*` directories were each followed with descriptors held for good (2,100 took a server to "
    "4,095 of 4,096) | fixed: a writer is followed once its journal exists, and at most 128 writers are followed "
    "(said once in the log) | tests/engine/test_sharing.py::test_empty_writer_directories_are_never_followed_and_"
    "followers_are_bounded |",
    "| 8 | Low: `writer_id: auto` with the worker in another process (data parallel > 1): the scheduler assumes "
    "`''` while the worker took `auto-1` | left, with the reason: no wrong KV (every load is checked against the "
    "journal of the store it reads), but the DP ranks do not share "
    "with each other and both announce as writer 0; a data-parallel deployment sets `writer_id` per rank "
    "(e.g. `\"{host}-dp0\"`) | - |",
    "| 9 | Low: a deeply nested own `manifest.json` refused the start with a bare RecursionError; `tutti "
    "inspect` allocated a sparse journal's apparent size (6.3 GiB RSS for 3 GiB) | fixed: the manifest is refused "
    "naming the file and the fix; the tools replay a journal a block at a time over its holes, as the store does. "
    "Left, as in the audit below (9a, 9b, 9c): inode reuse in a followed journal and a moved writer directory (misses, never wrong "
    "KV: every foreign chunk is checked), the follow cost | tests/store/test_store_hostile.py::test_a_deeply_nested_"
    "manifest_is_refused_naming_the_file, tests/tools/test_cli_hostile.py::test_inspect_never_allocates_a_sparse_"
    "journals_apparent_size |",
    "| 10 | Seen in passing: a slab that shrank under its writer is never re-extended; another writer's extras "
    "can announce or remove any key to a router; `ForeignStores` views were refreshed from the step thread and "
    "the asynchronous-load thread without a lock | fixed: the views' catch-up holds the store set's lock. Left, "
    "with reasons: a private writer's slabs (0600) shrink only by its own uid's hand, and its stores there fail "
    "(counted) until a restart, no wrong KV; announcements are advisory (a router's guess, every load is checked), "
    "and authenticating them needs the secret in the router | tests/engine/test_sharing.py (every test follows "
    "through `ForeignStores`) |",
]

#: The second audit's findings (#28), each with the test that fails without its fix, or the reason it is open.
ROUND_TWO = [
    "## Audit: sharing, mapped slabs and the tier",
    "",
    "| # | Finding | Status | Test (fails without the fix) |",
    "|---|---|---|---|",
    "| 1 | keyed tags do not bind the TP/PP rank: a group member can copy rank 1's files into rank 0's "
    "namespace | fixed: a tag binds the namespace digest it is right for (rank, geometry, model; not the writer), "
    "integrity `blake2b-mac-64-bound` (old keyed stores form another namespace) | "
    "tests/engine/worker/test_pipeline.py::test_keyed_tags_bind_the_rank |",
    "| 2 | another writer's manifest `slots_per_slab` 0/null/'64'/[] crashed the reader's step | fixed: validated "
    "on read, any failure of another writer's files fails that writer's chunks | "
    "tests/engine/test_sharing.py::test_another_writers_damaged_files_fail_its_chunks_never_the_step |",
    "| 2b | a member can hold `flock` on another member's group-writable LOCK or overwrite its manifest | fixed for "
    "named writers (`writer_id`, what replicas use): their directory is 2750, files 0640, LOCK 0600; left by design "
    "for the namespace's only writer (`writer_id` ''), a role the group's members take in turns over group-writable "
    "files whose every byte is checked against its keyed tag | "
    "tests/store/test_store_sharing.py::test_a_member_cannot_lock_replace_or_write_a_named_writers_directory |",
    "| 3 | mapped loads with a secret checked one read and copied another | fixed: no mapped loads with a secret "
    "(the file path verifies the staged copy the GPU receives) | tests/engine/worker/loads/test_mapped.py::test_a_secret_turns_mapped_loads_off |",
    "| 4 | SIGBUS: a slab truncated under its mapping | fixed for our own slabs (fstat before every mapped view: "
    "the file path fails the chunk); other writers' and readers' slabs are no longer mapped at all | "
    "tests/engine/worker/loads/test_mapped.py::test_a_mapped_slab_that_shrank_is_never_touched |",
    "| 5 | a refused foreign journal raised out of `start_step` | fixed: per-writer failures in the step's refresh "
    "fail that writer's chunks | tests/engine/test_sharing.py (the `journal hard link` case) |",
    "| 6 | the tier's namespace misses the weights' identity, CP sizes, layer names, layout | fixed: the weights' "
    "identity (as the connector's) and CP > 1 refused; left: layer names and layout, which the tier's bytes (vLLM's "
    "own CPU-tier blocks, `vllm-offload-chunk`) do not depend on beyond the chunk size already named | "
    "tests/vllm/test_tier.py::test_a_checkpoint_replaced_at_the_same_path_is_another_namespace |",
    "| 7 | `verify_checksums: false` with `writer_id` | fixed: refused at start, naming both | "
    "tests/engine/config/test_settings.py::test_checksums_off_is_refused_where_writers_share_a_root |",
    "| 8 | the layer-wise checksum's blind spots | fixed: format 2, two sums of position-tied MurmurHash3-mixed "
    "words (a few integer ops a word of a memory-bound pass; its H200 cost is not measured yet) | "
    "tests/kernels/test_checksum.py::test_no_blind_spots_of_the_linear_sums |",
    "| 9 | small items (stale tier slot, inode reuse, moved writer dirs, `{host}` cut, follow cost, list "
    "io_backend, NUL in share_group) | fixed: a tier load job for a key no longer held fails; `{host}` cut keeps a "
    "hash of the whole name; a list io_backend and a NUL in share_group refused naming the key. Left, with reasons: "
    "(a) a compacted journal's inode reused two compactions later: a follower that missed both replays from a wrong "
    "offset, which can only give records whose chunks fail their journal/checksum check at load (recomputed), never "
    "wrong KV; the fix is a generation number in the journal header, a format change for its own round; (b) a writer "
    "directory moved aside (`mv w-a w-a.bad`) is still followed through its open descriptor: its chunks are still "
    "checked against its journal and tags, and the restarted writer's new chunks are misses until the follower "
    "restarts; (c) following 2 writers x 200k chunks costs 0.2 s a round off the step (the scheduler's follower "
    "thread); the 55 ms worker step after one appended record is the foreign journal views' refresh, bounded by "
    "records appended, to be moved off the step with the follower | "
    "tests/engine/config/test_settings.py::test_round_two_small_config_items, "
    "tests/vllm/test_tier.py::test_a_load_job_for_a_chunk_no_longer_held_fails |",
    "| 10 | context parallelism (DCP/PCP > 1) | refused at start, naming the size (not in the fingerprint: "
    "nothing with them can start) | tests/engine/config/test_settings.py::test_context_parallelism_is_refused_by_name |",
    "| r1 | left from the first audit: a NUL byte in a root; the same root for two ranks; `tutti inspect` reading a whole "
    "journal into memory; a second writer after LOCK is unlinked; journal records piling up on a full disk | fixed: a "
    "NUL in a root and a directory listed twice as stripes refused naming the key. Left, with reasons: the same root "
    "for two ranks is by design (each rank's namespace is its own directory: the rank is in the fingerprint); a "
    "second writer after `LOCK` is unlinked stops the first from recording (it notices its lock is gone), so two "
    "writers never interleave; `tutti inspect`'s memory on a 3 GiB sparse journal and `close()` raising ENOSPC on a "
    "full disk lose nothing stored (records not written are chunks not journaled: misses) and are left for the "
    "store split (#30) | tests/engine/config/test_settings.py::test_a_nul_in_a_root_and_a_root_listed_twice_are_refused |",
    "| - | a load failing its checksum under vLLM's asynchronous scheduler gave wrong tokens (#25) | fixed: "
    "`async_loads` (auto there) | tests/vllm/test_connector.py::test_corrupt_chunk_is_recomputed_and_counted[async]; "
    "on the GPU: results/kv_proof.md |",
]

#: What the suite does not prove, stated next to what it does.
LIMITS = [
    "## Not covered here",
    "",
    "- Permission bits on the root: the suite runs as root, which ignores them; a read-only mount",
    "  stands in for an unwritable root.",
    "- Tensor and pipeline parallel layouts are checked at the planner (the index a TP=2 or PP=2",
    "  server would build over the root is empty), not with a multi-worker engine: this CPU box",
    "  runs one worker.",
    "- A checkpoint replaced in place is recognised by its files' sizes and sampled pages",
    "  (tutti.vllm.identity.model_identity), not by hashing every byte; a hub model id is",
    "  recognised by its cached snapshot's commit.",
    "- Timings in the last column come from a shared 2-core machine and vary with its load.",
]


def write_doc(rows: list[dict], path: str | os.PathLike = DOC, *, env: str = "") -> None:
    Path(path).write_text(render(rows, env=env))


if __name__ == "__main__":
    # RESULTS.json may be several files (a parallel run's per-worker results, RESULTS.json.gw0 ...):
    # their rows are merged; the table is written only when every test file of the folder is in them
    args = sys.argv[1:]
    out = DOC
    if len(args) > 1 and args[-1].endswith(".md"):
        out = args.pop()
    if not args:
        sys.exit("usage: report.py RESULTS.json [RESULTS.json.gw1 ...] [OUT.md]")
    rows, env = [], ""
    for a in args:
        r, e = load(a)
        rows += r
        env = env or e
    files = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    ran = {row["test"].split("::")[0].rsplit("/", 1)[-1] for row in rows}
    if files != ran:
        sys.exit(f"report.py: results cover {sorted(ran)}, not every test file {sorted(files)}; not written")
    write_doc(sorted(rows, key=lambda r: r["test"]), out, env=env)

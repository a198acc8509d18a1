"""What every command-line tool owes its user: `--version`, and a quiet end when the reader of its
output goes away (`tutti inspect --json ROOT | head`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tutti
from tutti.tools import cli

from test_cli import make_store  # a real store written by the real worker pipeline

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def run_into_closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    """Run `python -m tutti ARGV` with stdout a pipe whose reader has already gone: its first write
    fails with EPIPE, as under `| head` once head has exited."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "tutti", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                              env=ENV, cwd=REPO, timeout=120)
    finally:
        os.close(w)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"tutti {tutti.__version__}\n"
    p = subprocess.run([sys.executable, "-m", "tutti", "--version"], capture_output=True, text=True, env=ENV,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"tutti {tutti.__version__}" and p.stderr == ""


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    root = make_store(tmp_path / "kv")
    p = run_into_closed_pipe("inspect", "--json", str(root))
    assert p.stderr == "", p.stderr  # no "Broken pipe [EPIPE]", no "Exception ignored ..."
    assert p.returncode == cli.EXIT_BROKEN_PIPE == 141
    p = run_into_closed_pipe("inspect", str(root))  # the text form too
    assert (p.returncode, p.stderr) == (141, "")


def test_version_and_help_into_a_closed_pipe_end_quietly():
    for argv in (["--version"], ["inspect", "--help"]):
        p = run_into_closed_pipe(*argv)
        # argparse itself drops a failed write of its own messages and exits 0; either way, no noise
        assert p.stderr == "" and p.returncode in (0, 141), (argv, p.returncode, p.stderr)


def test_inspect_into_a_pipe_that_reads_everything_is_unchanged(tmp_path):
    root = make_store(tmp_path / "kv")
    p = subprocess.run([sys.executable, "-m", "tutti", "inspect", "--json", str(root)], capture_output=True, text=True,
                       env=ENV, cwd=REPO, timeout=120)
    assert p.returncode == 0 and p.stdout.lstrip().startswith("[") and p.stderr == ""


def test_the_tiny_models_files_share_one_mode_world_readable_under_umask_022(tmp_path):
    from tutti.tools.demo import make_tiny_model

    old = os.umask(0o022)
    try:
        d = make_tiny_model(tmp_path / "model")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes

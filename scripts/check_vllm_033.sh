#!/usr/bin/env bash
# vLLM 0.33 runs on no machine here (the GPU image has torch 2.11, the CPU build stops at 0.32),
# so its Python code is checked instead of run: fetch its wheel without dependencies, extract
# the `vllm` package (the dependencies installed here serve), and check that TuttiConnectorV1
# implements its connector API (scripts/check_vllm_api.py). Prints the site directory last.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${VLLM033_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tutti/vllm-0.33.0}
PY=${PYTHON:-python3}
if [ ! -f "$DIR/site/vllm/__init__.py" ]; then
  mkdir -p "$DIR"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps "vllm==0.33.0" -d "$DIR" 2>/dev/null
  "$PY" - "$DIR" <<'PYEOF'
import glob, sys, zipfile
d = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{d}/vllm-0.33.0-*.whl")[0]) as z:
    for n in z.namelist():
        if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith("vllm-0.33.0.dist-info/"):
            z.extract(n, f"{d}/site")
PYEOF
  rm -f "$DIR"/vllm-0.33.0-*.whl
fi
# The verdict is the exit status of this check; the site directory is printed either way, so that
# tests/vllm/test_api_check.py (which .ci/run points at it) fails on a mismatch instead of skipping.
PYTHONPATH="$DIR/site${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/check_vllm_api.py >&2 || status=$?
echo "$DIR/site"
exit "${status:-0}"

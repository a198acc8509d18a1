#!/usr/bin/env bash
# Check tutti against a vLLM release whose engine no machine here runs (the GPU image has torch
# 2.11, the CPU build stops at 0.32): fetch its wheel without dependencies, extract the `vllm`
# package's Python code (the dependencies installed here serve), and check that TuttiConnectorV1,
# TuttiHybridConnectorV1 and TuttiTier implement its API (scripts/check_vllm_api.py). Prints the
# site directory last.
#
#     bash scripts/check_vllm_033.sh            # vLLM 0.33.0
#     bash scripts/check_vllm_033.sh 0.34.0     # any release (scripts/check_vllm_034.sh says this)
#
# The CUDA wheel is ~240 MB (0.34.0: 239 MB, fetched in ~3 s and extracted in <1 s here); it is
# deleted once its Python code is extracted, and an extracted site is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${1:-0.33.0}
if [ "$VER" = "0.33.0" ] && [ -n "${VLLM033_DIR:-}" ]; then
  DIR=$VLLM033_DIR
else
  DIR=${VLLM_SITE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tutti/vllm-$VER}
fi
PY=${PYTHON:-python3}
if [ ! -f "$DIR/site/vllm/__init__.py" ]; then
  mkdir -p "$DIR"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps "vllm==$VER" -d "$DIR" 2>/dev/null
  "$PY" - "$DIR" "$VER" <<'PYEOF'
import glob, sys, zipfile
d, ver = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(f"{d}/vllm-{ver}-*.whl")[0]) as z:
    for n in z.namelist():
        if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(f"vllm-{ver}.dist-info/"):
            z.extract(n, f"{d}/site")
PYEOF
  rm -f "$DIR"/vllm-"$VER"-*.whl
fi
# The verdict is the exit status of this check; the site directory is printed either way, so that
# tests/vllm/test_api_check.py (which .ci/run points at it) fails on a mismatch instead of skipping.
PYTHONPATH="$DIR/site${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/check_vllm_api.py >&2 || status=$?
echo "$DIR/site"
exit "${status:-0}"

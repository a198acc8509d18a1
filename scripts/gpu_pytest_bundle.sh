#!/usr/bin/env bash
# Copies pytest (pure Python) into .gpu_pytest/ so a GPU machine without pytest and without a
# network can run the CUDA cases of the unit tests from a copy of this checkout:
#   bash scripts/gpu_pytest_bundle.sh        # here; then, on the GPU machine:
#   unset TRITON_INTERPRET; PYTHONPATH=$PWD/.gpu_pytest:$PYTHONPATH \
#       python3 -m pytest -q -x tests/engine/worker -k cuda
set -euo pipefail
cd "$(dirname "$0")/.."
sp=$(python3 -c "import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))")
rm -rf .gpu_pytest && mkdir -p .gpu_pytest
for m in pytest _pytest pluggy iniconfig py.py; do
  [ -e "$sp/$m" ] && cp -r "$sp/$m" .gpu_pytest/
done
# py-spy (a static binary) for `bench/serve_workload.py --py-spy auto`: who holds the GIL
tmp=$(mktemp -d)
if python3 -m pip download -q --no-deps py-spy -d "$tmp" >/dev/null 2>&1; then
  mkdir -p .gpu_pytest/bin
  python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "py_spy-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/py-spy"))
    with open(".gpu_pytest/bin/py-spy", "wb") as f:
        f.write(z.read(name))
os.chmod(".gpu_pytest/bin/py-spy", 0o755)
PY
else
  echo "py-spy not downloaded: bench/serve_workload.py --py-spy will not find it on the GPU machine" >&2
fi
rm -rf "$tmp"
du -sh .gpu_pytest

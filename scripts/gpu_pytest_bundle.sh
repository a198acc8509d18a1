#!/usr/bin/env bash
# Copies pytest (pure Python) into .gpu_pytest/ so the GPU machine, which has no pytest and no
# network, can run the CUDA cases of the unit tests:
#   bash scripts/gpu_pytest_bundle.sh
#   run(command="bash .gpu/setup.sh >/dev/null && . .gpu/env.sh && unset TRITON_INTERPRET && "
#               "PYTHONPATH=$PWD/.gpu_pytest:$PYTHONPATH python3 -m pytest -q -x tests/engine/test_worker.py -k cuda",
#       carry=[".gpu", ".gpu_pytest"])
set -euo pipefail
cd "$(dirname "$0")/.."
sp=$(python3 -c "import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))")
rm -rf .gpu_pytest && mkdir -p .gpu_pytest
for m in pytest _pytest pluggy iniconfig py.py; do
  [ -e "$sp/$m" ] && cp -r "$sp/$m" .gpu_pytest/
done
du -sh .gpu_pytest

#!/usr/bin/env bash
# On a GPU machine: the worker tests on CUDA (mapped loads registered for DMA
# included), the kernel launch sweep against copy_, and the pipeline load rate against the
# machine's ceilings, each written under $OUT as it finishes.
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh >/dev/null && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/worker/test_pipeline.py \
  tests/engine/worker/test_stores.py tests/engine/worker/test_async_loads.py tests/engine/worker/loads \
  tests/kernels/test_gather_scatter.py tests/kernels/test_checksum.py -k "cuda or grid_cap or quick or checksum" -x > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"
tail -3 "$OUT/tests.txt"
timeout 220 python3 bench/kernel_sweep.py --out "$OUT/kernel_sweep.json" > "$OUT/kernel_sweep.txt" 2>&1; echo "sweep rc=$?"
cat "$OUT/kernel_sweep.txt" | tail -5
timeout 200 python3 bench/load_rate.py --out "$OUT/load_rate.json" ${LOAD_ARGS:-} > "$OUT/load_rate.txt" 2>&1; echo "load rc=$?"
tail -30 "$OUT/load_rate.txt"

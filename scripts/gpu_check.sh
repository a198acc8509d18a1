#!/usr/bin/env bash
# On a GPU machine with vLLM installed: kernel conformance on CUDA, engine tests on CUDA, kernel
# bench, pipeline overlap (shm and disk), and a tiny vLLM store-then-load through the Triton kernels.
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -u
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "
import time; t=time.time()
from tutti.kernels import check_variant
r = check_variant('triton', device='cuda'); print('conformance', r, f'{time.time()-t:.1f}s')" 2>&1 | tail -3
python3 -m pytest -q -x tests/engine tests/io -p no:cacheprovider 2>&1 | tail -3
python3 -m pytest -q bench/test_kernels_bench.py -p no:cacheprovider --benchmark-json $OUT/kernels_bench.json 2>&1 | grep -vE "^\s*$" | tail -40
python3 bench/pipeline_overlap.py --root /dev/shm/tutti-ov --out $OUT/overlap_shm.json 2>&1 | tail -20
python3 bench/pipeline_overlap.py --root /tmp/tutti-ov --out $OUT/overlap_disk.json 2>&1 | tail -20
python3 bench/pipeline_overlap.py --root /dev/shm/tutti-ov2 --io-backend threads --out $OUT/overlap_shm_threads.json 2>&1 | tail -20

#!/usr/bin/env bash
# On a GPU machine with vLLM installed: conformance and engine tests on CUDA, pipeline overlap,
# and the TTFT table (recompute, tutti on /dev/shm and disk, vLLM's OffloadingConnector) in one go.
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -u
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh >/dev/null && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "
from tutti.kernels import check_variant
r = check_variant('triton', device='cuda'); print('conformance cases:', len(r.cases) if hasattr(r, 'cases') else r)" 2>&1 | tail -1 | cut -c1-200
python3 -m pytest -q -x tests/engine -p no:cacheprovider 2>&1 | tail -1
for spec in "shm auto /dev/shm/tutti-ov" "disk auto /tmp/tutti-ov"; do
  set -- $spec
  timeout 60 python3 bench/pipeline_overlap.py --root $3 --io-backend $2 --rounds 4 --out $OUT/overlap_$1.json 2>&1 | grep -E '"(io_s|compute_s|wall_s|overlap_efficiency|load_GBps|host_start|backend|matmul)' | tr -d '\n'; echo " <- $1"
done
timeout 300 python3 bench/vllm_ttft.py --out $OUT/ttft --cases recompute,tutti_shm,offloading --timeout 100 2>&1 | tail -32
cp $OUT/ttft/ttft.json $OUT/ttft/ttft.md $OUT/ttft/ttft.png $OUT/ 2>/dev/null; rm -rf $OUT/ttft

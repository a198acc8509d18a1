#!/usr/bin/env bash
# On a GPU machine with vLLM installed: pipeline overlap (shm uring/threads, disk) and the vLLM
# TTFT table.
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -u
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh >/dev/null && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
for spec in "shm auto /dev/shm/tutti-ov" "shm_threads threads /dev/shm/tutti-ov" "disk auto /tmp/tutti-ov"; do
  set -- $spec
  timeout 90 python3 bench/pipeline_overlap.py --root $3 --io-backend $2 --rounds 4 --out $OUT/overlap_$1.json 2>&1 | grep -E '"(io_s|compute_s|wall_s|overlap_efficiency|load_GBps|host_start|backend|matmul)' | tr -d '\n'; echo " <- $1"
done
timeout 460 python3 bench/vllm_ttft.py --out $OUT/ttft --timeout ${CASE_TIMEOUT:-150} 2>&1 | tail -40
cp $OUT/ttft/ttft.json $OUT/ttft/ttft.md $OUT/ttft/ttft.png $OUT/ 2>/dev/null
rm -rf $OUT/ttft/model

#!/usr/bin/env bash
# On a GPU machine with vLLM installed: bench/vllm_ttft.py in vLLM's default mode for one KV geometry
# (GEOMETRY=8b|70b), cases recompute, tutti on /dev/shm and on disk, vLLM's OffloadingConnector;
# then the default kernel launches against copy_ over several interleaved rounds.
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh >/dev/null && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G=${GEOMETRY:-8b}
timeout ${TTFT_TIMEOUT:-480} python3 bench/vllm_ttft.py --out "$OUT/ttft_$G" --geometry "$G" --no-decode \
  --lengths ${LENGTHS:-8192,32768} --cases ${CASES:-recompute,tutti_shm,tutti_disk,offloading} \
  --timeout ${CASE_TIMEOUT:-200} > "$OUT/ttft_$G.txt" 2>&1; echo "ttft rc=$?"
tail -25 "$OUT/ttft_$G.txt"
rm -rf "$OUT/ttft_$G/model"
if [ -n "${KERNEL_ROUNDS:-}" ]; then
  timeout 100 python3 bench/kernel_sweep.py --defaults-only "$KERNEL_ROUNDS" --out "$OUT/kernel_defaults.json" 2>&1 | tail -4
fi

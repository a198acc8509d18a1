#!/usr/bin/env bash
# The tiers comparison (results/tiers.md) on one H200 under vLLM 0.26, in parts of under ten
# minutes each: three 70B-class servers at a time (gpu util 0.31 each), 8 GiB of RAM
# for every case, a 32 GiB disk, 32 prefixes of 8192 tokens (a 20 GiB working set), 4 sends each.
# On a card of less than about 100 GB two such servers do not fit together: there the servers of a
# part run one at a time (--sequential, added by this script).
#   bash scripts/gpu_tiers.sh 1   # none, tier_fs (vLLM CPU + fs), tutti_tiered       prefix repetition
#   bash scripts/gpu_tiers.sh 2   # offloading (CPU 8 GiB), tier_tutti, tutti_disk    prefix repetition
#   bash scripts/gpu_tiers.sh 3   # part 1's cases, Zipf popularity
#   bash scripts/gpu_tiers.sh 4   # part 2's cases, Zipf popularity
#   bash scripts/gpu_tiers.sh 5   # tutti_tiered, tutti_tiered_nopromo: promotions A/B (two disk tiers fit the disk)
#   bash scripts/gpu_tiers.sh 6   # none, offloading, tutti_shm with 32 GiB of RAM each: everything fits, the
#                                 # ceiling any cache reaches on part 1's workload
#   bash scripts/gpu_tiers.sh 7   # none, offloading, tutti_tiered with 32 GiB of RAM each (the disk tier behind),
#                                 # Zipf popularity: everything fits
#   bash scripts/gpu_tiers.sh 8   # none, tutti_disk (32 GiB), tutti_tiered (8 GiB RAM + 32 GiB disk) on the 8B
#                                 # geometry: 48 prefixes of 4096 tokens (24 GiB), vLLM's GPU KV 8 GiB
#   bash scripts/gpu_tiers.sh 9   # tier_fs, tutti_tiered alone (two servers, part 1's workload): tutti against
#                                 # vLLM's pair, the shortest comparison of the two
#   bash scripts/gpu_tiers.sh 10  # part 9's cases on Zipf popularity
#   bash scripts/gpu_tiers.sh 11  # tier_fs, tutti_tiered, tutti_tiered_stage (promote "stage"), prefix repetition
#   bash scripts/gpu_tiers.sh 12  # part 11's cases on Zipf popularity
#   bash scripts/gpu_tiers.sh proof   # scripts/gpu_kv_proof.py --cases tiered
# Results land in $OUT (default /tmp/out): each part's serve_workload JSON and table. EXTRA adds arguments
# to serve_workload (EXTRA="--profile-steps 200 --profile-delay 400" traces each server's steps).
# (.gpu/setup.sh and .gpu/env.sh, where the checkout has them, set up that environment first.)
set -u
if [ -f .gpu/setup.sh ]; then bash .gpu/setup.sh >/dev/null && . .gpu/env.sh || exit 1; fi
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMON="--geometry 70b --capacity 8GiB --disk-capacity 32GiB --kv-cache-bytes 4294967296 --num-prefixes 32
        --prefix-len 8192 --repeats 4 --gpu-memory-utilization 0.31 --start-timeout 240 --bench-timeout 420"
case "${1:-}" in
  1) cases=none,tier_fs,tutti_tiered; workload=prefix_repetition ;;
  2) cases=offloading,tier_tutti,tutti_disk; workload=prefix_repetition ;;
  3) cases=none,tier_fs,tutti_tiered; workload=zipf ;;
  4) cases=offloading,tier_tutti,tutti_disk; workload=zipf ;;
  5) cases=tutti_tiered,tutti_tiered_nopromo; workload=prefix_repetition ;;
  6) cases=none,offloading,tutti_shm; workload=prefix_repetition; COMMON="$COMMON --capacity 32GiB" ;;
  7) cases=none,offloading,tutti_tiered; workload=zipf; COMMON="$COMMON --capacity 32GiB" ;;
  8) cases=none,tutti_disk,tutti_tiered; workload=prefix_repetition
     COMMON="$COMMON --geometry 8b --num-prefixes 48 --prefix-len 4096 --kv-cache-bytes 8589934592" ;;
  9) cases=tier_fs,tutti_tiered; workload=prefix_repetition ;;
  10) cases=tier_fs,tutti_tiered; workload=zipf ;;
  11) cases=tier_fs,tutti_tiered,tutti_tiered_stage; workload=prefix_repetition; seq=1 ;;
  12) cases=tier_fs,tutti_tiered,tutti_tiered_stage; workload=zipf; seq=1 ;;
  proof) exec timeout 560 python3 scripts/gpu_kv_proof.py --cases tiered --out "$OUT/kv_proof_tiered" ;;
  *) echo "usage: $0 1|2|3|4|5|6|7|8|9|10|11|12|proof" >&2; exit 2 ;;
esac
# two 70B-class servers (or three of the 8B geometry) need more than an 80 GB card holds; three
# disk roots of 20-32 GiB (parts 11, 12) more than the 64 GiB disk: one server at a time there
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
case " ${EXTRA:-} " in
  *" --sequential "*) ;;
  *) if [ -n "${seq:-}" ] || [ "${mem:-0}" -lt 100000 ]; then EXTRA="${EXTRA:-} --sequential"; fi ;;
esac
# the disk's rates of the day (4 GiB, O_DIRECT, one request at a time): the bound every disk case works under
mkdir -p /tmp/tutti-disk-probe
{ dd if=/dev/zero of=/tmp/tutti-disk-probe/f bs=16M count=256 oflag=direct 2>&1 | tail -1 | sed 's/^/write: /'
  dd if=/tmp/tutti-disk-probe/f of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | sed 's/^/read: /'
} | tee "$OUT/disk_probe_${1}.txt"
rm -rf /tmp/tutti-disk-probe
# shellcheck disable=SC2086 # COMMON and EXTRA are lists of arguments
timeout 570 python3 bench/serve_workload.py --out "$OUT/tiers_${1}_${workload}" --cases "$cases" --workload "$workload" $COMMON ${EXTRA:-}
status=$?
cp "$OUT/tiers_${1}_${workload}"/*.json "$OUT/tiers_${1}_${workload}"/*.md "$OUT"/ 2>/dev/null
exit $status

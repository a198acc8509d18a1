#!/usr/bin/env bash
# The README's test command: every test on the CPU, Triton through its interpreter.
# Test files run on two workers (pytest-xdist, one file per worker at a time: tests of one file
# share fixtures and may share names on disk); TUTTI_TEST_JOBS=1 runs them in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
export PYTHONUNBUFFERED=1
jobs=${TUTTI_TEST_JOBS:-2}
par=()
if [ "$jobs" != "1" ] && python3 -c "import xdist" 2>/dev/null; then
  par=(-n "$jobs" --dist loadfile)
fi
exec python3 -m pytest -q -p no:cacheprovider "${par[@]}" tests "$@"

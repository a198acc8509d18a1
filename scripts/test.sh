#!/usr/bin/env bash
# The README's test command: every test on the CPU, Triton through its interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
export PYTHONUNBUFFERED=1
exec python3 -m pytest -q -p no:cacheprovider tests "$@"

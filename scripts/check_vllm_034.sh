#!/usr/bin/env bash
# vLLM 0.34's Python code extracted and tutti checked against its API (see check_vllm_033.sh).
# Prints the site directory last; .ci/run exports it as TUTTI_VLLM034_SITE.
exec bash "$(dirname "$0")/check_vllm_033.sh" 0.34.0

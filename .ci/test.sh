#!/usr/bin/env bash
# The test command: lint, then the whole suite (unit, distributed on gloo, functional).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash .ci/setup.sh
.venv/bin/ruff check megatron_fsdp megatron tests examples benchmarks tools pretrain_gpt.py
.venv/bin/python -m pytest -q tests "$@"

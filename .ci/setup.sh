#!/usr/bin/env bash
# Create .venv with the CPU build of torch and the package (editable) plus test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test,training]"
# megatron-core, beside (not in) the test environment: tests/distributed/test_mcore_adapter.py runs the
# adapter against it in a separate process, while the rest of the suite proves we work without it.
.venv/bin/pip install -q --no-deps --target .venv/extras/mcore megatron-core==0.16.1

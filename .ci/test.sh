#!/usr/bin/env bash
# The test commands (README.md gives them at the top):
#   bash .ci/test.sh                  lint, then the whole suite (unit, distributed on gloo, functional): what CI
#                                     runs (.ci/run); about 28 minutes on 2 cores
#   bash .ci/test.sh quick            lint, the unit tests, the docs' examples and claims, one distributed suite (2, 4
#                                     ranks): a few minutes, for the edit-test loop
#   bash .ci/test.sh [quick] ARGS...  the same with more pytest arguments (-x, -k NAME)
#   bash .ci/test.sh gpu [ARGS...]    docs/gpu.md's first checks on a lent GPU within 8 minutes, a table written to
#                                     gpu_first_checks.md (tools/gpu_first_checks.py; ARGS: --wheels DIR, --out FILE);
#                                     without a GPU it says so and exits 0. Uses $PYTHON, else .venv's, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = gpu ]; then
  shift
  PY="${PYTHON:-}"
  [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
  exec "$PY" tools/gpu_first_checks.py "$@"
fi
[ -x .venv/bin/python ] || bash .ci/setup.sh
.venv/bin/ruff check megatron_fsdp megatron tests examples benchmarks tools pretrain_gpt.py
QUICK=(tests/unit tests/docs/test_doc_snippets.py tests/docs/test_doc_claims.py tests/distributed/core/test_fsdp2_idioms.py)
if [ "${1:-}" = quick ]; then
  shift
  .venv/bin/python -m pytest -q "${QUICK[@]}" "$@"
else
  .venv/bin/python -m pytest -q --durations=30 tests "$@"  # the slowest 30: where the suite's time goes
fi

#!/usr/bin/env bash
# Create .venv with torch 2.13.0 (the CPU build wherever pip can get it) and the package (editable)
# plus its test and training extras. Where torch comes from, in this order (README.md says the same):
#   1. a torch 2.13.0 wheel in pip's --find-links locations (PIP_FIND_LINKS or pip's config), offline;
#   2. PyTorch's CPU-only index;
#   3. the default package index, whatever it serves for torch==2.13.0 (a CUDA build on Linux x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
python3 -m venv .venv
PIP=.venv/bin/pip
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
has_torch() {
  .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null
}
if has_torch; then
  origin="already installed"
elif $PIP install -q --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
  origin="a local wheel (pip's find-links)"
elif $PIP install -q --no-deps --timeout 30 --retries 1 --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" >/dev/null 2>&1; then
  origin="PyTorch's CPU index"
else
  origin="the default package index"
fi
$PIP install -q "torch==$TORCH_VERSION"  # torch's own dependencies (and torch itself after step 3)
# megatron-core (the front-end's model and foundation, pinned in the training extra) before the package, so that a
# platform without its wheel (macOS: megatron-core ships Linux wheels only; its sdist compiles a C++ extension) stops
# here with what it needs instead of a compiler's trace. torch is installed already, so pip keeps that build.
MCORE_VERSION=0.16.1
if ! mcore_log=$($PIP install -q "megatron-core==$MCORE_VERSION" 2>&1); then
  echo "$mcore_log" | tail -n 5 >&2
  echo "setup: error: megatron-core==$MCORE_VERSION could not be installed on $(uname -s) $(uname -m)." \
       "It has wheels for Linux (x86_64, aarch64) only; elsewhere (macOS) pip builds its source distribution," \
       "which compiles a C++ extension and needs a C++ compiler (macOS: xcode-select --install) and pybind11" \
       "(.venv/bin/pip install pybind11), then run .ci/setup.sh again. README.md, \"Set-up on macOS\"." >&2
  exit 1
fi
$PIP install -q -e ".[test,training]"
# After numpy is installed (with the training extra): importing torch before that warns "Failed to initialize NumPy".
.venv/bin/python -c 'import sys, torch; build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"; print(f"setup: torch {torch.__version__} ({build} build) from {sys.argv[1]}")' "$origin"
# torchao for the float8 all-gather tests (tests/distributed/core/test_float8.py, which skip without it). --no-deps:
# it needs only torch; its CUDA kernels fail to load on CPU (a warning) and float8 training runs without them.
$PIP install -q --no-deps "torchao==0.18.0" || echo "setup: torchao not installed; the float8 tests will skip"

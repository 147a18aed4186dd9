"""Distributed checkpointing: save/resume, resharding, interop, export (checks in checkpoint_checks.py)."""

from tests.distributed.checkpoint import checkpoint_checks
from tests.distributed.harness import pytest_suite

results, test_checkpoint = pytest_suite(checkpoint_checks)

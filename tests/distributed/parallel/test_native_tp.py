"""Torch-native DTensor TP composed with per-module fully_shard (TP2 x DP2 at 4 gloo ranks, TP2 x DP1 at 2)."""

from tests.distributed.harness import pytest_suite
from tests.distributed.parallel import native_tp_checks

results, test_native_tp = pytest_suite(native_tp_checks, world_sizes=(2, 4))

"""Gradient path probes: accumulation, second backwards, recomputation, Megatron calls, user hooks."""

from tests.distributed.core import grad_path_checks
from tests.distributed.harness import pytest_suite

results, test_grad_path = pytest_suite(grad_path_checks)

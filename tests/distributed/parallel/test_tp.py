"""Megatron-style context-parallel split and vocabulary-parallel cross entropy at 2 gloo ranks."""

from tests.distributed.harness import pytest_suite
from tests.distributed.parallel import tp_checks

results, test_tp = pytest_suite(tp_checks, world_sizes=(2,))

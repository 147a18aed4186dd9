"""Whole-model API checkpoints use the model's own FQNs (no wrapper prefix), at 2 and 4 gloo ranks."""

from tests.distributed.api import wrapper_prefix_checks
from tests.distributed.harness import pytest_suite

results, test_wrapper_prefix = pytest_suite(wrapper_prefix_checks)

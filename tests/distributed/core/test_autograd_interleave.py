"""Autograd interleavings (several forwards, one backward; backwards in turn) at 2 and 4 gloo ranks."""

from tests.distributed.core import autograd_interleave_checks
from tests.distributed.harness import pytest_suite

results, test_autograd_interleave = pytest_suite(autograd_interleave_checks)

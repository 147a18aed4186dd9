"""Data-dependent execution (units that run on some ranks only) at 2 and 4 gloo ranks, against DDP."""

from tests.distributed.core import dynamic_checks
from tests.distributed.harness import pytest_suite

results, test_dynamic = pytest_suite(dynamic_checks)

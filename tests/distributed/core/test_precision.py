"""Mixed precision (bf16 compute, fp32 main weights) at 2 and 4 ranks."""

from tests.distributed.core import precision_checks
from tests.distributed.harness import pytest_suite

results, test_precision = pytest_suite(precision_checks)

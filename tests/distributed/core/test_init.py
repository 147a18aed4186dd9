"""Meta-device initialisation at 2 and 4 ranks."""

from tests.distributed.core import init_checks
from tests.distributed.harness import pytest_suite

results, test_init = pytest_suite(init_checks)

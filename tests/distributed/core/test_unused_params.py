"""Parameters without a gradient on any rank keep .grad None (DDP, FSDP2 semantics) at 2 and 4 ranks."""

from tests.distributed.core import unused_param_checks
from tests.distributed.harness import pytest_suite

results, test_unused_params = pytest_suite(unused_param_checks)

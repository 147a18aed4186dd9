"""Parameters given values or replaced after fully_shard, and dropped models, at 2 and 4 gloo ranks."""

from tests.distributed.core import fsdp2_replace_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_replace = pytest_suite(fsdp2_replace_checks)

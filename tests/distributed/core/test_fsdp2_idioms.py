"""FSDP2's idioms (PyTorch's FSDP2 test scenarios) on megatron_fsdp at 2 and 4 gloo ranks."""

from tests.distributed.core import fsdp2_idiom_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_idioms = pytest_suite(fsdp2_idiom_checks)

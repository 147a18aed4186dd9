"""FSDP2's FSDPModule controls (set_is_last_backward, explicit prefetch, ...) on megatron_fsdp at 2 and 4 gloo ranks."""

from tests.distributed.core import fsdp2_control_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_controls = pytest_suite(fsdp2_control_checks)

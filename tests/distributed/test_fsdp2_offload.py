"""FSDP2's CPU offload and reshard_after_forward=N on megatron_fsdp at 2 and 4 gloo ranks."""

from tests.distributed import fsdp2_offload_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_offload = pytest_suite(fsdp2_offload_checks)

"""PyTorch's FSDP2 test scenarios (test/distributed/_composable/fsdp/) on megatron_fsdp at 2 gloo ranks (4 for some)."""

from tests.distributed.core import fsdp2_port_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_port = pytest_suite(fsdp2_port_checks)

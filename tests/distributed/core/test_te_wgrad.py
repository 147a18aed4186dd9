"""TransformerEngine-style fused wgrad accumulation into main_grad (CPU emulation) at 2 ranks."""

from tests.distributed.core import te_wgrad_checks
from tests.distributed.harness import pytest_suite

results, test_te_wgrad = pytest_suite(te_wgrad_checks, world_sizes=(2,))

"""A unit split into several flat buffers for padding, at 2 and 4 gloo ranks: DDP parity and checkpoints."""

from tests.distributed.harness import pytest_suite
from tests.distributed.sharding import layout_split_checks

results, test_layout_split = pytest_suite(layout_split_checks)

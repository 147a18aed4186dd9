"""The front-end's meshes and groups are megatron-core's (layout_checks.py), at 4 and 8 gloo ranks."""

from tests.distributed.frontend import layout_checks
from tests.distributed.harness import pytest_suite

results, test_layout = pytest_suite(layout_checks, world_sizes=(4, 8))

"""The front-end's meshes and groups are megatron-core's (layout_checks.py), at 4 and 8 gloo ranks.

In processes of their own (harness group "layout"): the checks count the process groups a job creates, which
is a count over the whole process; in the shared group's processes, earlier suites' state made pretrain at
TP2 x DP2 create single-rank groups that a fresh process does not (seen once in CI, not yet explained).
"""

from tests.distributed.frontend import layout_checks
from tests.distributed.harness import pytest_suite

results, test_layout = pytest_suite(layout_checks, world_sizes=(4, 8), group="layout")

"""FSDP2's fully_shard keywords (mp_policy, reshard_after_forward=None, ignored_params, lists of modules,
shard_placement_fn, dp_mesh_dims) on megatron_fsdp, compared with FSDP2 itself at 2 gloo ranks."""

from tests.distributed.core import fsdp2_keyword_checks
from tests.distributed.harness import pytest_suite

results, test_fsdp2_keywords = pytest_suite(fsdp2_keyword_checks, world_sizes=(2,))

"""Whole-model API (fully_shard_model, MegatronFSDP, fully_shard_optimizer, clipping) at 2 and 4 gloo ranks."""

from tests.distributed.api import api_checks
from tests.distributed.harness import pytest_suite

results, test_api = pytest_suite(api_checks)

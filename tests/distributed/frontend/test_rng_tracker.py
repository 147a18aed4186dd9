"""megatron-core's CUDA RNG tracker states through front-end checkpoints, at 2 gloo ranks."""

from tests.distributed.frontend import rng_tracker_checks
from tests.distributed.harness import pytest_suite

results, test_rng_tracker = pytest_suite(rng_tracker_checks)

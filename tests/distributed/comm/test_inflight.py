"""Asynchronous work at 2 and 4 gloo ranks: failures lose no work and free no buffer in use."""

from tests.distributed.comm import inflight_checks
from tests.distributed.harness import pytest_suite

results, test_inflight = pytest_suite(inflight_checks)

"""Core engine at 2 and 4 gloo ranks: parity with DDP and single-process, bytes, DTensor, errors."""

from tests.distributed.core import engine_checks
from tests.distributed.harness import pytest_suite

results, test_engine = pytest_suite(engine_checks)

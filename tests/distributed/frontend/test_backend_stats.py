"""The front-end's ``num zeros`` and ``params norm`` over sharded gradients (backend_stats_checks.py), 2 and 4 ranks."""

from __future__ import annotations

from tests.distributed.frontend import backend_stats_checks
from tests.distributed.harness import pytest_suite

results, test_backend_stats = pytest_suite(backend_stats_checks)

"""The engine on the side-stream path with recording stand-in streams, at 2 and 4 gloo ranks."""

from tests.distributed.comm import stream_order_checks
from tests.distributed.harness import pytest_suite

results, test_stream_order = pytest_suite(stream_order_checks)

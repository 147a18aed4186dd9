"""HSDP at 4 ranks (2 x 2)."""

import pytest

from tests.distributed import hsdp_checks
from tests.distributed.harness import names, run_suite


@pytest.fixture(scope="module")
def failures():
    return run_suite(hsdp_checks.__name__, hsdp_checks.SUITE, 4)


@pytest.mark.parametrize("name", names(hsdp_checks.SUITE, 4))
def test_hsdp(failures, name):
    assert not failures[name], "\n".join(failures[name])

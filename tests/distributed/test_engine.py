"""Core engine at 2 and 4 gloo ranks: parity with DDP and single-process, bytes, DTensor, errors."""

import pytest

from tests.distributed import engine_checks
from tests.distributed.harness import names, run_suite

MODULE = engine_checks.__name__


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_suite(MODULE, engine_checks.SUITE, request.param)


ALL = sorted({name for n in (2, 4) for name in names(engine_checks.SUITE, n)})


@pytest.mark.parametrize("name", ALL)
def test_engine(results, name):
    world_size, failures = results
    if name not in failures:
        pytest.skip(f"{name} does not run at world size {world_size}")
    assert not failures[name], "\n".join(failures[name])

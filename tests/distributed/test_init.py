"""Meta-device initialisation at 2 and 4 ranks."""

import pytest

from tests.distributed import init_checks
from tests.distributed.harness import names, run_suite


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_suite(init_checks.__name__, init_checks.SUITE, request.param)


@pytest.mark.parametrize("name", sorted({x for n in (2, 4) for x in names(init_checks.SUITE, n)}))
def test_init(results, name):
    world_size, failures = results
    if name not in failures:
        pytest.skip(f"{name} does not run at world size {world_size}")
    assert not failures[name], "\n".join(failures[name])

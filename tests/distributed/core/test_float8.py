"""torchao float8 training with FSDP2's all-gather extension at 2 and 4 ranks; skipped without torchao."""

import pytest

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")

from tests.distributed.core import float8_checks  # noqa: E402
from tests.distributed.harness import pytest_suite  # noqa: E402

results, test_float8 = pytest_suite(float8_checks)

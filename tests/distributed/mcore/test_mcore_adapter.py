"""The Megatron adapter at 2 and 4 gloo ranks without megatron-core.

``.ci/setup.sh`` installs megatron-core (no dependencies: it runs on CPU for
what the adapter touches) into ``.venv/extras/mcore``, outside the test
environment's path, so the rest of the suite proves the library works without
it; test_mcore_model.py runs the same checks in a process that has it (in one
spawned group with megatron-core's GPTModel checks).
"""

from __future__ import annotations

from tests.distributed.harness import pytest_suite
from tests.distributed.mcore import mcore_adapter_checks

results, test_mcore_adapter = pytest_suite(mcore_adapter_checks)

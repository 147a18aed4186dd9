"""FSDP2's CPU offload and reshard_after_forward=N on megatron_fsdp at 2 and 4 gloo ranks (and on a GPU if any)."""

import pytest
import torch

from tests.distributed.core import fsdp2_offload_checks
from tests.distributed.harness import pytest_suite, spawn_and_collect

results, test_fsdp2_offload = pytest_suite(fsdp2_offload_checks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPU offload's host/device split needs a GPU")
def test_cpu_offload_on_cuda(tmp_path) -> None:
    (run,) = spawn_and_collect(fsdp2_offload_checks.cuda_offload_worker, str(tmp_path), nprocs=1)
    assert run["error"] is None, run["error"]

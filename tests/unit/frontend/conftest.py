"""Fixtures of the front-end's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_gloo_rank():
    """A one-rank gloo group for a test module's megatron-core models (its parallel state destroyed after)."""
    import torch.distributed as dist

    from tests.conftest import _free_port_env

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    _free_port_env()
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    from megatron.training.mcore_model import destroy_mcore_parallel

    destroy_mcore_parallel()
    dist.destroy_process_group()

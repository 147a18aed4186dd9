"""Fixtures shared by the whole suite.

No ``sys.path`` edits are needed: ``tests/`` is a package (it has ``__init__.py``), so pytest's default
"prepend" import mode puts the checkout's root first on ``sys.path`` before importing any test, and
everything imports as ``tests.<...>``, ``megatron_fsdp`` and ``pretrain_gpt`` from the checkout (ahead of
an editable install of another one). Ranks started with ``torch.multiprocessing`` (spawn) get the
parent's ``sys.path``; subprocesses run ``python -m tests....`` with ``cwd`` at the root.
"""

import os
import socket

import pytest


def _free_port_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.fixture
def gloo_rank():
    """A one-rank gloo process group for one test (skips if this process already has a group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    _free_port_env()
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL process group on GPU 0 for the CUDA tests (skips without CUDA/NCCL)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA GPU and NCCL")
    _free_port_env()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

import os
import socket
import sys

import pytest

# Tests import the helpers in tests/ and the package from the checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL process group on GPU 0 for the CUDA tests (skips without CUDA/NCCL)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA GPU and NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

"""Issue 17's smaller GPU fixes: the device a unit lives on, the grad norm's device under NCCL, the pool's
CUDA frees without a host stall; the fused-wgrad main_grad path on one GPU. The CPU parts run here; the CUDA
parts skip cleanly without a GPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.core.shard_module import mesh_device
from megatron_fsdp.memory.allocator import BufferPool
from tests.distributed.core.te_wgrad_checks import STRATEGIES, assert_same, build, shard, train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL")


def test_the_device_index_given_is_the_device_used():
    cuda, cpu = SimpleNamespace(device_type="cuda"), SimpleNamespace(device_type="cpu")
    assert mesh_device(cuda, "cuda:1") == torch.device("cuda", 1)  # not current_device()
    assert mesh_device(cuda, torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert mesh_device(cpu, "cpu") == mesh_device(cpu) == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda:1' does not match the mesh's device type 'cpu'"):
        mesh_device(cpu, "cuda:1")


@needs_cuda
def test_without_an_index_the_current_device_is_used():
    assert mesh_device(SimpleNamespace(device_type="cuda"), "cuda") == torch.device("cuda", torch.cuda.current_device())


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fully_shard_model_lives_on_the_device_it_was_given(nccl_group):
    from megatron_fsdp import fully_shard_model
    from megatron_fsdp.core.lookup import units_of

    torch.cuda.set_device(0)
    model = fully_shard_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to("cuda:1"), device="cuda:1",
                              fsdp_unit_modules=[nn.Linear])
    for unit in units_of(model.module):
        for group in unit.groups:
            assert group.device == torch.device("cuda", 1) and group.shard.device == torch.device("cuda", 1)
    out = model(torch.randn(2, 8, device="cuda:1"))
    out.sum().backward()
    assert all(p.grad.device == torch.device("cuda", 1) for p in model.parameters())


@needs_cuda
def test_grad_norm_reduces_on_the_gpu_without_gradients_and_with_host_gradients(nccl_group):
    from megatron_fsdp.optim.grad_norm import get_grad_norm

    params = [nn.Parameter(torch.ones(3, device="cuda")), nn.Parameter(torch.ones(2, device="cuda"))]
    empty = get_grad_norm(params)  # no gradients on this rank: still a CUDA tensor NCCL can reduce
    assert empty.device.type == "cuda" and empty.item() == 0.0
    host = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]  # CPU offload: gradients on the host
    host[0].grad, host[1].grad = torch.full((3,), 2.0), torch.full((2,), 1.0)
    norm = get_grad_norm(host)
    assert norm.device.type == "cuda"
    torch.testing.assert_close(norm.cpu(), torch.tensor(14.0).sqrt())


@needs_cuda
def test_pool_trim_does_not_stall_the_host():
    pool = BufferPool()
    out = pool.tensor(1 << 20, torch.float32, torch.device("cuda"))
    out.fill_(1.0)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued after the use
    pool.release_tensor(out)
    start = time.perf_counter()
    freed = pool.trim()
    took = time.perf_counter() - start
    stream_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert freed >= 4 << 20
    assert stream_busy and took < 0.1, f"trim waited {took:.3f} s for the GPU"
    again = torch.zeros(1 << 20, device="cuda")  # the freed memory is reused only after the queued work
    assert again.sum().item() == 0.0


@needs_cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fused_wgrad_on_one_gpu_trains_like_plain_autograd(nccl_group, strategy):
    """te_wgrad_checks' tied model at world size 1 on CUDA: main_grad taken in forward, two backwards per step."""
    with torch.device("cuda"):
        plain = train(shard(build(fused=False), strategy), steps=3, backwards_per_step=2)
        fused = train(shard(build(fused=True, read_in_forward=True), strategy), steps=3, backwards_per_step=2)
    assert all(p.is_cuda for p in fused)
    assert_same(fused, plain, f"{strategy} on one GPU", rtol=1e-6, atol=1e-7)  # cuBLAS may pick other kernels

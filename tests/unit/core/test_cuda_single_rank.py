"""CUDA/NCCL at world size 1: the engine's GPU path. Skips cleanly without a GPU."""

import copy

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL")


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_cuda_training_matches_plain_model(nccl_group, strategy):
    from megatron_fsdp import MixedPrecisionPolicy, fully_shard
    from tests.models import Net, local_batch, loss_fn

    torch.manual_seed(0)
    base = Net().cuda()
    plain = copy.deepcopy(base)
    model = copy.deepcopy(base)
    for block in [*model.blocks, model.probe]:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    assert all(p.device.type == "cuda" for p in model.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
    for step in range(3):
        batch = local_batch(step, 0, 1).cuda()
        for m in (model, plain):
            loss_fn(m, batch).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=name)

    bf16 = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in [*bf16.blocks, bf16.probe]:
        fully_shard(block, sharding_strategy=strategy, mp_policy=policy)
    fully_shard(bf16, sharding_strategy=strategy, mp_policy=policy)
    loss = loss_fn(bf16, local_batch(0, 0, 1).cuda())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad.dtype == torch.float32 for p in bf16.parameters() if p.grad is not None)

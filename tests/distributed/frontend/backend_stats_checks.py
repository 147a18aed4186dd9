"""The front-end's logged statistics over sharded gradients (megatron/training/backends.py): ``num zeros`` and
``params norm`` equal what one process computes on the full tensors, for our ragged shards and FSDP2's.

The gradients have exact zeros by construction (embedding rows no token used, a ReLU's dead units), on
parameters whose sizes do not divide by the world size, so shards are uneven and some ranks hold none of
a parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.training.backends import FSDPBackend, TorchFSDP2Backend
from megatron.training.parallel_state import GroupOfRanks, ParallelLayout
from megatron_fsdp import fully_shard
from megatron_fsdp.parallel import TensorParallel
from tests.distributed.harness import check, device

SUITE = "backend_stats"


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 5)  # 13 rows: uneven shards; rows no token uses get zero gradients
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(tokens)))).square().sum()


def _wrap(model: nn.Module, backend: str) -> nn.Module:
    if backend == "ours":
        for layer in (model.up, model.down):
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    for layer in (model.up, model.down):
        fsdp2_shard(layer)
    return fsdp2_shard(model)


@check(SUITE, world_sizes=(2, 4), params={"backend": ["ours", "fsdp2"]})
def num_zeros_and_params_norm_count_each_entry_once(backend: str) -> None:
    torch.manual_seed(7)
    replica = _Tiny().to(device())
    torch.manual_seed(7)  # the same initial weights
    model = _wrap(_Tiny().to(device()), backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.tensor([[1, 4, 4, 9]], device=device()) + r % 2 for r in range(world)]
    model(batches[rank]).backward()
    for batch in batches:
        replica(batch).backward()
    for p in replica.parameters():
        p.grad /= world  # the data-parallel mean, as the sharded gradients hold it
    world_group = dist.group.WORLD
    layout = ParallelLayout(mesh=None, tp=TensorParallel.single(), cp=GroupOfRanks.single(), dp_group=world_group,
                            grad_group=world_group, dp_rank=rank, dp_size=world)
    cls = FSDPBackend if backend == "ours" else TorchFSDP2Backend
    stats = cls(model, device(), layout)
    expected_zeros = sum(int((p.grad == 0).sum()) for p in replica.parameters())
    assert expected_zeros >= (13 - 6) * 5, expected_zeros  # the 7 embedding rows no batch uses, at least
    assert stats.num_zeros_in_grad() == expected_zeros, (stats.num_zeros_in_grad(), expected_zeros)
    expected_norm = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in replica.parameters()]))
    assert abs(stats.params_norm() - float(expected_norm)) <= 1e-6 * float(expected_norm), (
        stats.params_norm(), float(expected_norm))


@check(SUITE, world_sizes=(4,))
def pretrain_gpt_hsdp_reduces_across_replicas_once_per_step() -> None:
    """pretrain_gpt.py with --num-distributed-optimizer-instances 2 (dp_outer 2 x dp_shard 2), ZeRO-3: the outer
    all-reduces per iteration are the same with 1 and 4 micro-batches (global batch 8 and 32 at micro-batch 2),
    while the inner reduce-scatters run once per micro-batch (4x)."""
    import contextlib
    import io

    from megatron.training.training import pretrain
    from megatron_fsdp import comm_stats
    from pretrain_gpt import forward_step, model_provider

    per_iteration = {}
    for global_batch in (8, 32):
        argv = ("--mock-data --vocab-size 60 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                f"--micro-batch-size 2 --global-batch-size {global_batch} --train-iters 2 --log-interval 2 "
                "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                "--num-distributed-optimizer-instances 2").split()
        comm_stats.reset()
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(model_provider, forward_step, argv)
        per_iteration[global_batch] = {k: comm_stats.calls[k] / 2 for k in ("all_reduce", "reduce_scatter")}
    one, four = per_iteration[8], per_iteration[32]
    assert one["all_reduce"] > 0 and four["all_reduce"] == one["all_reduce"], per_iteration
    assert four["reduce_scatter"] == 4 * one["reduce_scatter"] > 0, per_iteration
    if dist.get_rank() == 0:
        print(f"pretrain_gpt HSDP calls per iteration (1 vs 4 micro-batches): {per_iteration}")

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
from megatron.training.parallel_state import ParallelLayout
from megatron_fsdp import fully_shard
from megatron_fsdp.parallel import TensorParallel
from megatron_fsdp.parallel.context import ContextParallel
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
    layout = ParallelLayout(mesh=None, tp=TensorParallel.single(), cp=ContextParallel.single(), dp_group=world_group,
                            grad_group=world_group, dp_rank=rank, dp_size=world)
    cls = FSDPBackend if backend == "ours" else TorchFSDP2Backend
    stats = cls(model, device(), layout)
    expected_zeros = sum(int((p.grad == 0).sum()) for p in replica.parameters())
    assert expected_zeros >= (13 - 6) * 5, expected_zeros  # the 7 embedding rows no batch uses, at least
    assert stats.num_zeros_in_grad() == expected_zeros, (stats.num_zeros_in_grad(), expected_zeros)
    expected_norm = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in replica.parameters()]))
    assert abs(stats.params_norm() - float(expected_norm)) <= 1e-6 * float(expected_norm), (
        stats.params_norm(), float(expected_norm))

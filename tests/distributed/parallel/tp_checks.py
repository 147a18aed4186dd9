"""Megatron-style tensor and context parallelism helpers (megatron_fsdp.parallel): the load-balanced context-parallel
split and the vocabulary-parallel cross entropy against the full softmax. fp32; tolerance 1e-5 relative to the
largest value. (The checks that split the project's own GPT went with it: megatron-core's GPTModel under TP, SP and
CP is checked in tests/distributed/mcore and the functional tp2/cp2 configurations.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp.parallel import ContextParallel, TensorParallel, vocab_parallel_cross_entropy
from megatron_fsdp.parallel.tp_group import take_partition
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check, device_type

SUITE = "tp"
RTOL = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= RTOL, f"{what}: max relative difference {error:.3g} > {RTOL}"


def _groups(tp_size: int, cp_size: int, sequence_parallel: bool) -> tuple[TensorParallel, ContextParallel]:
    mesh = init_device_mesh(device_type(), (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
    return (TensorParallel.from_group(mesh.get_group("tp"), sequence_parallel),
            ContextParallel.from_group(mesh.get_group("cp")))


@check(SUITE, world_sizes=(2,))
def context_parallel_split_is_load_balanced():
    cp = _groups(1, 2, False)[1]
    assert cp.sequence_indices(8, rank=0).tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert cp.sequence_indices(8, rank=1).tolist() == [2, 3, 4, 5]
    assert cp.gathered_indices(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    expect_error(ValueError, "divisible by 2 x --context-parallel-size (4)", cp.sequence_indices, 6)


@check(SUITE, world_sizes=(2,))
def vocab_parallel_cross_entropy_matches_full_softmax():
    tp = TensorParallel.from_group(dist.group.WORLD)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 5, 10, generator=g) * 4).requires_grad_()
    target = torch.randint(0, 10, (3, 5), generator=g)
    expected = F.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), reduction="none").view(3, 5)
    local = take_partition(logits.detach(), tp, 2).requires_grad_()
    losses = vocab_parallel_cross_entropy(local, target, tp)
    _close(losses, expected, "per-token losses")
    weights = torch.rand(3, 5, generator=g)
    (expected * weights).sum().backward()
    (losses * weights).sum().backward()
    _close(local.grad, take_partition(logits.grad, tp, 2), "logit gradients")

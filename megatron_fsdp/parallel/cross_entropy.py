"""Cross-entropy over vocabulary-parallel logits, without gathering them (Megatron's algorithm).

Each TP rank holds logits for its slice of the vocabulary. Three all-reduces over
TP (the maximum, the target's logit, the sum of exponentials) give every rank the
per-token loss; the backward is local: ``softmax - one_hot(target)`` on each slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fsdp.comm.lending import on_aliases
from megatron_fsdp.parallel.comm_bytes import record
from megatron_fsdp.parallel.tp_group import TensorParallel


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        logits_max = logits.max(dim=-1).values
        record("tp_all_reduce", logits_max)
        on_aliases(dist.all_reduce, logits_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - logits_max.unsqueeze(-1)
        rows = logits.shape[-1]
        start = tp.rank * rows
        outside = (target < start) | (target >= start + rows)
        local = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        record("tp_all_reduce", predicted)
        on_aliases(dist.all_reduce, predicted, group=tp.group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        record("tp_all_reduce", sum_exp)
        on_aliases(dist.all_reduce, sum_exp, group=tp.group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_input.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad_input.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Per-token losses (``target``'s shape) from logits split along the vocabulary (last dim) across ``tp``."""
    if tp.size == 1:
        flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        return flat.view_as(target)
    return _VocabParallelCrossEntropy.apply(logits, target, tp)

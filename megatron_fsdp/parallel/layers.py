"""Megatron's tensor-parallel layers: column- and row-parallel linears, the vocabulary-parallel embedding.

Each layer holds this rank's slice of the weight and initialises it by drawing the
full weight from the global random stream and keeping its slice (Megatron's
``--use-cpu-initialization`` scheme). Every TP rank therefore consumes the stream
exactly as the unsplit layer would: TP-replicated parameters come out identical
across TP ranks, and a TP run starts from the weights of the same run without TP
(on the meta device too: ``reset_parameters`` does it). The cost is one full weight
per layer transiently at initialisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fsdp.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_fsdp.parallel.tp_group import TensorParallel, set_tensor_model_parallel_attributes, take_partition


def _full_normal_(param: nn.Parameter, full_shape: tuple[int, ...], std: float, tp: TensorParallel, dim: int,
                  segments: Sequence[int] | None = None) -> None:
    """Fill ``param`` (this rank's slice) from a full N(0, std) draw of ``full_shape``."""
    with torch.no_grad():
        if tp.size == 1:
            nn.init.normal_(param, mean=0.0, std=std)
            return
        full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
        nn.init.normal_(full, mean=0.0, std=std)
        param.copy_(take_partition(full, tp, dim, segments))


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by output columns: each rank computes its slice of ``Y``.

    Input: replicated across TP (or, with sequence parallelism, split along the sequence
    and gathered here). Output: split along the last dim unless ``gather_output``.
    ``segments``: the output is a concatenation of parts split separately (fused QKV).
    """

    def __init__(self, in_features: int, out_features: int, std: float, tp: TensorParallel, bias: bool = True,
                 gather_output: bool = False, segments: Sequence[int] | None = None) -> None:
        super().__init__()
        self.tp, self.std, self.gather_output = tp, std, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.segments = None if segments is None else tuple(segments)
        local_out = tp.divide(out_features, "the output size of a column-parallel linear")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None
        set_tensor_model_parallel_attributes(self.weight, True, 0, segments=self.segments)
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, True, 0, segments=self.segments)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _full_normal_(self.weight, (self.out_features, self.in_features), self.std, self.tp, 0, self.segments)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by input rows: partial products summed across TP.

    Input: split along the last dim (a column-parallel layer's output). Output:
    replicated, or with sequence parallelism reduce-scattered along the sequence.
    The bias is added after the reduction, once; it is TP-replicated, and under
    sequence parallelism each rank's gradient covers only its part of the sequence
    (``sequence_parallel`` marks it for the all-reduce over TP).
    """

    def __init__(self, in_features: int, out_features: int, std: float, tp: TensorParallel,
                 bias: bool = True) -> None:
        super().__init__()
        self.tp, self.std = tp, std
        self.in_features, self.out_features = in_features, out_features
        local_in = tp.divide(in_features, "the input size of a row-parallel linear")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, False, 0)
            self.bias.sequence_parallel = tp.sequence_parallel
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _full_normal_(self.weight, (self.out_features, self.in_features), self.std, self.tp, 1)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split across TP; lookups summed across TP.

    Output: replicated across TP (the caller splits it along the sequence under
    sequence parallelism).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.std = tp, std
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = tp.divide(num_embeddings, "the (padded) vocabulary size")
        self.vocab_start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _full_normal_(self.weight, (self.num_embeddings, self.embedding_dim), self.std, self.tp, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.rows)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.tp)

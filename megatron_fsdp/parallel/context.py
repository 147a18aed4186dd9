"""Context parallelism: the sequence split across ranks, attention exact over the whole sequence.

Megatron's load-balanced causal split: the sequence is cut into ``2 C`` chunks and
CP rank ``r`` keeps chunks ``r`` and ``2 C - 1 - r``, so every rank has the same share
of the causal attention's work. Attention gathers keys and values from every CP rank
(an all-gather forward, a reduce-scatter backward) and masks by the chunks' sequence
positions: each query sees exactly the keys it would see on one rank with the whole
sequence. A ring (overlapping the exchange with compute) is the next step; the
all-gather costs one sequence of K/V per layer per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp.parallel.mappings import gather_along, reduce_scatter_along


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group: its size and this rank's index in it."""

    group: dist.ProcessGroup | None  # None: size 1
    size: int = 1
    rank: int = 0

    @classmethod
    def single(cls) -> ContextParallel:
        return cls(None, 1, 0)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> ContextParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def sequence_indices(self, full_length: int, rank: int | None = None, device: torch.device | None = None
                         ) -> torch.Tensor:
        """The positions (in the whole sequence) of ``rank``'s tokens: chunks ``rank`` and ``2 C - 1 - rank``."""
        rank = self.rank if rank is None else rank
        if self.size == 1:
            return torch.arange(full_length, device=device)
        if full_length % (2 * self.size):
            raise ValueError(
                f"sequence length {full_length} must be divisible by 2 x --context-parallel-size ({2 * self.size}) "
                "for the load-balanced split"
            )
        chunk = full_length // (2 * self.size)
        first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        second = torch.arange((2 * self.size - 1 - rank) * chunk, (2 * self.size - rank) * chunk, device=device)
        return torch.cat([first, second])

    def gathered_indices(self, full_length: int, device: torch.device | None = None) -> torch.Tensor:
        """The sequence positions of the keys after ``gather_sequence`` (rank-major order)."""
        return torch.cat([self.sequence_indices(full_length, r, device) for r in range(self.size)])

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (the whole sequence along ``dim``)."""
        if self.size == 1:
            return x
        return x.index_select(dim, self.sequence_indices(x.shape[dim], device=x.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        return gather_along(x, cp.group, cp.size, dim, kind="cp")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along(grad, ctx.cp.group, ctx.cp.size, ctx.dim, kind="cp"), None, None


def gather_sequence(x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
    """Every CP rank's tokens of ``x`` along ``dim``, rank-major (gradients reduce-scattered back)."""
    return x if cp.size == 1 else _GatherSequence.apply(x, cp, dim)


def causal_mask(cp: ContextParallel, local_length: int, device: torch.device) -> torch.Tensor:
    """``[local queries, gathered keys]``: True where the key's position is at or before the query's."""
    full = local_length * cp.size
    queries = cp.sequence_indices(full, device=device)
    keys = cp.gathered_indices(full, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)

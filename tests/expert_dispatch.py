"""Expert parallelism: the expert-parallel group and the all-to-all that moves tokens to their experts.

Ranks are laid out as Megatron lays them out (expert tensor parallelism 1):
expert parallelism varies fastest, so ranks ``[d * P, (d + 1) * P)`` form one
expert-parallel (EP) group and ranks ``{e, e + P, e + 2P, ...}`` form EP rank
``e``'s expert data-parallel (EDP) group, over which its experts are sharded.
EP rank ``e`` holds the experts ``[e * L, (e + 1) * L)`` with ``L = E / P``.

``all_to_all`` is written once as an autograd function whose backward is the
same all-to-all with the splits swapped: the backward of dispatch is combine and
the backward of combine is dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp.comm.lending import on_aliases
from megatron_fsdp.parallel.comm_bytes import record


@dataclass(frozen=True)
class ExpertParallel:
    """An expert-parallel group: its size and this rank's index in it (``group`` None: size 1)."""

    group: dist.ProcessGroup | None
    size: int = 1
    rank: int = 0

    @classmethod
    def single(cls) -> ExpertParallel:
        """No expert parallelism: every expert is local."""
        return cls(None, 1, 0)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> ExpertParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def local_experts(self, num_experts: int) -> range:
        """The global indices of this rank's experts, or an error naming the flags when they do not divide."""
        if num_experts % self.size:
            raise ValueError(
                f"--num-experts ({num_experts}) must be divisible by --expert-model-parallel-size ({self.size})"
            )
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class _AllToAll(torch.autograd.Function):
    """Rows ``send_splits[r]`` of the input go to rank ``r``; ``recv_splits[r]`` rows come from it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    record("ep_all_to_all", x)
    on_aliases(dist.all_to_all_single, out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], ep: ExpertParallel) -> torch.Tensor:
    """Exchange rows of ``x`` over the EP group (differentiable; identity at size 1)."""
    if ep.size == 1:
        return x
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), ep.group)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """``counts[r, j]``: rows this rank sends to rank ``r``'s local expert ``j``; returns what each rank sends here.

    The result's row ``s`` holds the rows source rank ``s`` sends to each of this rank's experts.
    """
    if ep.size == 1:
        return counts.clone()
    received = torch.empty_like(counts)
    record("ep_all_to_all", counts)
    on_aliases(dist.all_to_all_single, received, counts.contiguous(), group=ep.group)
    return received


@dataclass
class Dispatch:
    """What combine needs of one dispatch: the permutation, the splits and the regrouping."""

    order: torch.Tensor  # assignment (token * k + slot) of each permuted row, grouped by global expert
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    regroup: torch.Tensor  # received row of each row grouped by local expert
    expert_rows: list[int]  # rows per local expert (after regrouping)


def dispatch(x: torch.Tensor, indices: torch.Tensor, num_experts: int,
             ep: ExpertParallel) -> tuple[torch.Tensor, Dispatch]:
    """Send each token to the ranks of its ``k`` experts; return the rows grouped by local expert.

    ``x``: ``[tokens, hidden]``; ``indices``: ``[tokens, k]`` global expert indices.
    Rows reach a local expert ordered by source rank, then by token (no capacity: no drop).
    """
    k = indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order within one
    permuted = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    local = num_experts // ep.size
    counts = torch.bincount(flat, minlength=num_experts).view(ep.size, local)
    received_counts = exchange_counts(counts, ep)  # [source rank, local expert]
    send_splits = counts.sum(1).tolist()
    recv_splits = received_counts.sum(1).tolist()
    received = all_to_all(permuted, send_splits, recv_splits, ep)
    # Received rows are ordered (source, local expert): regroup them (local expert, source).
    starts = torch.cumsum(received_counts.reshape(-1), 0) - received_counts.reshape(-1)
    starts = starts.view(ep.size, local).tolist()
    sizes = received_counts.tolist()
    pieces = [torch.arange(starts[s][j], starts[s][j] + sizes[s][j], device=x.device)
              for j in range(local) for s in range(ep.size)]
    regroup = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=x.device)
    expert_rows = received_counts.sum(0).tolist()
    return received.index_select(0, regroup), Dispatch(order, send_splits, recv_splits, regroup, expert_rows)


def combine(expert_out: torch.Tensor, probs: torch.Tensor, plan: Dispatch, ep: ExpertParallel,
            num_tokens: int) -> torch.Tensor:
    """Return each expert output to its token's rank and sum the ``k`` outputs weighted by ``probs``."""
    k = probs.shape[1]
    back = torch.empty_like(expert_out).index_copy(0, plan.regroup, expert_out)  # (source, local expert) order
    returned = all_to_all(back, plan.recv_splits, plan.send_splits, ep)  # permuted order again
    weights = probs.reshape(-1).index_select(0, plan.order).unsqueeze(1).to(returned.dtype)
    tokens = torch.div(plan.order, k, rounding_mode="floor")
    out = returned.new_zeros((num_tokens, returned.shape[1]))
    return out.index_add(0, tokens, returned * weights)

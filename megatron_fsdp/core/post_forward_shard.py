"""``reshard_after_forward=N`` (FSDP2's int form, DeepSpeed's hpZ): a smaller shard kept between forward and backward.

After forward a unit frees its gathered weights but keeps 1/N of them: the shard
group (``W`` ranks) is cut into ``W/N`` sub-groups of ``N`` consecutive ranks, and the
rank at position ``p`` of its sub-group keeps piece ``p`` of the ``N`` equal pieces of
the gathered flat buffer. Backward then all-gathers within the sub-group only.

Which gathers take the sub-group path must be the same on every rank (every rank
issues every agreed gather, docs/design.md section 5a), so pieces are made and dropped
at events every rank sees alike: a piece is stored whenever an all-gather of the
group lands during a forward with grad enabled (the unit's own gather or a
participation into scratch, which every rank issues), and dropped at the end of the
backward or when the weights go stale. A gather finds a piece on every rank or on none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_fsdp.comm.local_groups import new_local_group

_SUB_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class PostForwardMesh:
    """This rank's sub-group of the shard group for the post-forward shard."""

    size: int  # N: ranks in the sub-group
    position: int  # this rank's place in it: the piece it keeps
    ranks: tuple[int, ...]  # global ranks, in sub-group rank order
    group: dist.ProcessGroup


def check_post_forward_size(size: int, shard_size: int, *, where: str = "fully_shard") -> None:
    """``size`` must be a factor of the shard-group size."""
    if size < 1 or shard_size % size:
        raise ValueError(
            f"{where}: reshard_after_forward={size} must be a positive factor of the dp_shard size {shard_size} "
            f"(the post-forward shard is spread over groups of that many consecutive ranks); "
            f"valid: {[n for n in range(1, shard_size + 1) if shard_size % n == 0]}, True or False"
        )


def post_forward_mesh(shard_group: dist.ProcessGroup, size: int) -> PostForwardMesh:
    """This rank's sub-group of ``size`` consecutive ranks of ``shard_group`` (made once per rank set).

    Made by its member ranks only (``comm/local_groups.py``); every rank of the
    shard group calls this in the same ``fully_shard``, so each sub-group is complete.
    """
    ranks = dist.get_process_group_ranks(shard_group)  # in shard-group rank order
    me = dist.get_rank(shard_group)
    start = me // size * size
    members = tuple(ranks[start:start + size])
    if members not in _SUB_GROUPS:
        backend = str(dist.get_backend(shard_group))
        _SUB_GROUPS[members] = new_local_group(list(members), backend, "post_forward")
    group = _SUB_GROUPS[members]
    if dist.get_rank(group) != me - start:  # a process group orders its ranks ascending
        raise NotImplementedError(
            f"reshard_after_forward={size}: the shard group's ranks {ranks} are not in ascending order; "
            "the post-forward sub-groups need them ascending (use True or False)"
        )
    return PostForwardMesh(size, me - start, members, group)

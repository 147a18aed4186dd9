"""Process groups made by their member ranks only, whatever groups the job made before.

``dist.new_group(ranks, use_local_synchronization=True)`` lets the members of a group
make it without the other ranks, which the engine needs where different ranks ask for
different rank sets at the same point (the data-parallel groups of a TP x DP job). torch
names such a group by its ranks and by how many process groups the calling rank already
belongs to (``distributed_c10d._hash_ranks_to_str``), and the members meet in the store
under that name. A group made earlier on some ranks only (``new_group([0, 1, 2])`` in a
4-rank job: rank 3 is no member) leaves the members with different counts, so each waits
under its own name until the store's timeout (30 minutes by default), with no error.

``new_local_group`` first has the members publish their counts in the default store; the
ranks that belong to fewer groups make single-rank groups (which need no peer) until every
member's count is the same, so the names agree.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# What a rank made only to align its group count: kept, as a destroyed group would lower it again.
_PADDING: list[dist.ProcessGroup] = []
# How many member-made groups each (purpose, rank set) has had: the members make them in the same
# order, so the n-th one has the same store keys on each of them.
_MADE: dict[tuple[str, tuple[int, ...]], int] = {}


def group_count() -> int:
    """The number of process groups this rank belongs to (what torch hashes into a local group's name)."""
    return len(c10d._world.pg_names)


def new_local_group(ranks: list[int], backend: str, purpose: str) -> dist.ProcessGroup:
    """``dist.new_group(ranks, use_local_synchronization=True)``, called by the members of ``ranks`` only.

    ``purpose`` and the order of calls must be the same on every member (the store keys that
    align the members' group counts are named by them).
    """
    ranks = sorted(ranks)
    if len(ranks) == 1 or dist.get_backend() == "fake":
        # one member has no one to agree with; torch's fake process group (a simulated rank of a
        # large job) has a store without set/get and no peers to meet
        return dist.new_group(ranks, backend=backend, use_local_synchronization=True)
    key = (purpose, tuple(ranks))
    serial = _MADE[key] = _MADE.get(key, -1) + 1
    rank = dist.get_rank()
    store = c10d._get_default_store()
    prefix = f"megatron_fsdp/local_group/{purpose}/{'_'.join(map(str, ranks))}/{serial}"
    store.set(f"{prefix}/{rank}", str(group_count()))
    counts = [int(store.get(f"{prefix}/{member}")) for member in ranks]  # get waits for each member's key
    while group_count() < max(counts):
        _PADDING.append(dist.new_group([rank], backend=backend, use_local_synchronization=True))
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True)

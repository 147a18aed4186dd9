"""Our DTensors' specs are never ``==`` a plain-``Shard`` spec (issue 25, item 2).

torch's C++ DTensor dispatch caches sharding propagation per op and input specs and
confirms a hit with ``==`` alone when two keys meet in one probe of its table.
``RaggedShard(0, sizes) == Shard(0)``, so, on about 1% of same-shaped pairs in a process
(which ones depends on hash values that differ per process), a ``detach`` of an FSDP2
parameter came back labelled with our ``RaggedShard`` (or ours with ``Shard(0)``).
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_fsdp.sharding.ragged_shard import RaggedShard
from megatron_fsdp.sharding.ragged_spec import RaggedSpec, strict_spec

PAIRS = 600  # before the fix about 6 of 600 pairs were confused in every process tried (3 runs)


@contextlib.contextmanager
def fake_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _pair(mesh, rows: int) -> tuple[DTensor, DTensor]:
    ours_rows = rows // 3  # not torch.chunk's split
    placement = RaggedShard(0, (ours_rows, rows - ours_rows))
    ours = strict_spec(DTensor.from_local(torch.zeros(ours_rows, 2), mesh, [placement],
                                          shape=torch.Size([rows, 2]), stride=(2, 1), run_check=False))
    theirs = DTensor.from_local(torch.zeros((rows + 1) // 2, 2), mesh, [Shard(0)], shape=torch.Size([rows, 2]),
                                stride=(2, 1), run_check=False)
    return ours, theirs


def test_no_op_on_a_plain_shard_is_served_our_placement_or_the_reverse():
    confused = []
    with fake_mesh() as mesh:
        for rows in range(2, PAIRS + 2):
            ours, theirs = _pair(mesh, rows)
            ours.detach()  # cached first: a plain DTensor of the same shape must not be served it
            if type(theirs.detach().placements[0]) is not Shard:
                confused.append(("theirs", rows))
        for rows in range(PAIRS + 2, 2 * PAIRS + 2):
            ours, theirs = _pair(mesh, rows)
            theirs.detach()
            if not isinstance(ours.detach().placements[0], RaggedShard):
                confused.append(("ours", rows))
    assert not confused, f"{len(confused)} detaches took the other library's placement: {confused[:5]}"


def test_the_spec_survives_what_users_do_with_parameters():
    with fake_mesh() as mesh:
        ours, theirs = _pair(mesh, 13)
        assert type(ours._spec) is RaggedSpec and ours._spec != theirs._spec and theirs._spec != ours._spec
        assert ours.placements == theirs.placements  # placements still compare equal (in-place ops rely on it)
        param = strict_spec(torch.nn.Parameter(ours))
        assert type(param._spec) is RaggedSpec and param._spec == ours._spec and hash(param._spec) == hash(ours._spec)
        assert type(copy.deepcopy(ours)._spec) is RaggedSpec
        buffer = io.BytesIO()
        torch.save(ours, buffer)
        buffer.seek(0)
        assert type(torch.load(buffer, weights_only=False)._spec) is RaggedSpec
        assert ours.add_(1).placements[0] == RaggedShard(0, (4, 9))  # in-place keeps our placement

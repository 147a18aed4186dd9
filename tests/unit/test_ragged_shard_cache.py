"""DTensor's sharding-propagation cache must keep RaggedShard and plain Shard(0) apart.

With ``Shard(0) == RaggedShard(...)`` an op on an ordinary ``Shard(0)`` DTensor of the
same shape and mesh reused our cached placement, so FSDP2's optimizer state in the
same process got our row split (wrong DCP offsets: "overlapping chunks").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp.ragged_shard import RaggedShard

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", rank=0, world_size=2, store=fake_pg.FakeStore())
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def test_ops_keep_each_placement(mesh):
    def make(placement, rows):
        return DTensor.from_local(torch.ones(rows, 5), mesh, [placement], run_check=False,
                                  shape=torch.Size((4, 5)), stride=(5, 1))

    ragged, other, plain = make(RaggedShard(0, (3, 1)), 3), make(RaggedShard(0, (2, 2)), 2), make(Shard(0), 2)
    for tensor in (ragged, other, plain):  # ragged first: its result is cached before plain's lookup
        out = torch.zeros_like(tensor)
        assert out.placements == tensor.placements and type(out.placements[0]) is type(tensor.placements[0])
        assert out.to_local().shape == tensor.to_local().shape
    assert RaggedShard(0, (3, 1)) != RaggedShard(0, (2, 2))
    assert not RaggedShard(0, (3, 1)) == Shard(0) and not Shard(0) == RaggedShard(0, (3, 1))  # noqa: SIM201

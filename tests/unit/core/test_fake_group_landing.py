"""Under torch's fake process group nothing waits by the clock (issue 25, item 4).

The fake group runs every collective at issue, but its works answer ``is_completed()``
``False`` for ever. ``RootState.track`` polls the oldest reduction beyond the in-flight
limit for up to ``LANDING_WAIT_S`` (core/state.py), so a step with 48 units cost 48 x 50 ms
there; a work whose future is done has landed (``collectives.work_completed``).
``benchmarks/fake_pg_step.py`` measures the step against FSDP2's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_fsdp import fully_shard
from megatron_fsdp.comm.collectives import work_completed
from megatron_fsdp.core import state


@contextlib.contextmanager
def fake_world(world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fake_works_have_landed():
    with fake_world(8):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        assert not work.is_completed()  # what the fake group says; if torch changes it, this test can go
        assert work_completed(work)


def test_a_step_of_48_units_never_polls_by_the_clock(monkeypatch):
    timed_out = []
    real = state._landed_within

    def counting(reduce, seconds):
        landed = real(reduce, seconds)
        timed_out.append(not landed)
        return landed

    monkeypatch.setattr(state, "_landed_within", counting)
    with fake_world(8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(48)])
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert len(timed_out) >= 2 * (48 - 2), "the in-flight limit was never reached: the test checks nothing"
    assert not any(timed_out), f"{sum(timed_out)} waits ran out their {state.LANDING_WAIT_S} s"


def test_sequence_parallel_after_fully_shard_raises_what_parallelism_md_says():
    """docs/parallelism.md quotes torch's refusal (issue 25): nothing of ours runs before it to word another."""
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    with fake_world(2):
        model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        fully_shard(model)
        weight = model[0].weight
        with pytest.raises(RuntimeError, match="local_tensor argument only accepts torch.Tensor but got"):
            parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": SequenceParallel()})
        assert model[0].weight is weight  # left unchanged

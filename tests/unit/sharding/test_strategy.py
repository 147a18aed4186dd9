import pytest
import torch
from torch import nn

import megatron_fsdp
from megatron_fsdp.sharding.strategy import STRATEGIES, resolve_strategy


def test_presets_are_data():
    assert [(p.params, p.grads, p.optim) for p in STRATEGIES.values()] == [
        (False, False, False), (False, False, True), (False, True, True), (True, True, True)]
    assert resolve_strategy(3) is STRATEGIES["optim_grads_params"]
    assert resolve_strategy("optim") is STRATEGIES["optim"]


@pytest.mark.parametrize("bad", ["zero3", 4, True, None])
def test_unknown_strategy_names_valid_ones(bad):
    with pytest.raises(ValueError, match="valid: 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'"):
        resolve_strategy(bad)


def test_fully_shard_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        megatron_fsdp.fully_shard(nn.Linear(2, 2))


def test_package_imports_with_torch_alone():
    """Importing the library loads neither megatron-core nor TransformerEngine (a fresh interpreter: other
    tests of this process import megatron-core; tests/unit/test_without_megatron_core.py blocks it)."""
    import subprocess
    import sys

    code = ("import sys, megatron_fsdp; assert megatron_fsdp.fully_shard.__doc__; "
            "print(sorted(m for m in sys.modules if m.startswith(('megatron.core', 'transformer_engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert torch.__version__


def test_fully_shard_runs_against_the_fake_process_group():
    """One rank of an 8-rank job: the cross-rank model check reads 'equal' (one all-reduce that
    returns its input), the root's replicated scalar still makes a unit, and a step runs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
        model.register_parameter("gate", nn.Parameter(torch.tensor(0.5)))
        for layer in (model[0], model[2]):
            megatron_fsdp.fully_shard(layer)
        root = megatron_fsdp.fully_shard(model)
        assert isinstance(root, megatron_fsdp.FSDPModule)
        assert [g.plan.name for g in root.fsdp_unit.groups] == ["no_shard"]
        rows = model[0].weight.placements[0].local_sizes
        assert len(rows) == 8 and sum(rows) == 9, rows  # the layout for 8 ranks was built
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
        with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
            megatron_fsdp.fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")
    finally:
        dist.destroy_process_group()

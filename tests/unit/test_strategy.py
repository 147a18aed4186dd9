import pytest
import torch
from torch import nn

import megatron_fsdp
from megatron_fsdp.strategy import STRATEGIES, resolve_strategy


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
    import sys

    assert "megatron.core" not in sys.modules and "transformer_engine" not in sys.modules
    assert megatron_fsdp.fully_shard.__doc__ and torch.__version__

"""mcore_cp_attention.py without process groups: Megatron's load-balanced chunks, and the layer-spec substitution.

The attention itself runs on 4 gloo ranks in tests/distributed/mcore/mcore_cp_checks.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron.training.mcore_cp_attention import (
    ContextParallelDotProductAttention,
    sequence_positions,
    with_context_parallel_core_attention,
)
from megatron.training.mcore_mla import mla_local_layer_spec


class _Group:
    """A stand-in process group: get_batch_on_this_cp_rank reads only its size and rank (once torch.distributed
    says it is initialised)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_sequence_positions_are_megatron_cores_split(cp, monkeypatch):
    """Rank r holds chunks r and 2C-1-r: the positions megatron-core's get_batch_on_this_cp_rank keeps, every rank's
    together covering the sequence once."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    length = 4 * cp
    seen = []
    for rank in range(cp):
        positions = sequence_positions(length, cp, rank)
        theirs = get_batch_on_this_cp_rank({"tokens": torch.arange(length).unsqueeze(0)}, cp_group=_Group(cp, rank))
        assert torch.equal(positions, theirs["tokens"][0]), (rank, positions)
        seen += positions.tolist()
    assert sorted(seen) == list(range(length))


def test_sequence_length_must_divide_by_twice_the_cp_size():
    with pytest.raises(ValueError, match="divisible by 2 x the context-parallel size"):
        sequence_positions(6, 2, 0)


def test_every_layer_gets_the_context_parallel_core_attention():
    """A layer spec, a block spec of layer specs, and the front-end's MLA spec: the core attention is replaced."""
    layer = with_context_parallel_core_attention(gpt_layer_specs.get_gpt_layer_local_spec())
    assert layer.submodules.self_attention.submodules.core_attention is ContextParallelDotProductAttention
    mla = with_context_parallel_core_attention(mla_local_layer_spec())
    assert mla.submodules.self_attention.submodules.core_attention is ContextParallelDotProductAttention

    class Block:
        layer_specs = [gpt_layer_specs.get_gpt_layer_local_spec(), gpt_layer_specs.get_gpt_layer_local_spec()]

    block = with_context_parallel_core_attention(Block())
    assert all(spec.submodules.self_attention.submodules.core_attention is ContextParallelDotProductAttention
               for spec in block.layer_specs)

"""Where each rank's tensor-parallel slice lands in the full checkpoint tensor (``checkpoint.model_parallel``).

The chunks of every (TP rank, data-parallel row block) must tile the full tensor
exactly once, each holding the full tensor's values at its offsets: checked by
scattering them into an empty tensor, for plain, fused (QKV with grouped-query
heads, SwiGLU ``[gate | up]``) and row-parallel (``partition_dim`` 1) weights, with
row blocks that cut through segments and blocks that are empty. The write items
DCP gets carry the same offsets.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

from megatron_fsdp.checkpoint.model_parallel import (
    ChunkedTensor,
    ModelParallel,
    TensorParallelSlice,
    checkpoint_value,
    full_shape,
    staged_copy,
)
from megatron_fsdp.parallel.tp_group import TensorParallel, set_tensor_model_parallel_attributes, take_partition


def _row_blocks(rows: int, sizes: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each data-parallel rank's rows; ``sizes`` sum to ``rows`` (ragged, zeros allowed)."""
    assert sum(sizes) == rows
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))


@pytest.mark.parametrize("shape, dim, segments, tp_size, dp_sizes", [
    ((12, 5), 0, None, 2, [4, 2]),  # plain column-parallel
    ((16, 3), 0, (8, 4, 4), 2, [3, 0, 5]),  # QKV: 8 query rows, 4 K, 4 V; a block cuts Q and K, one is empty
    ((16, 3), 0, (8, 4, 4), 4, [1, 2, 1]),  # QKV at TP 4: one row per K/V segment per rank
    ((12,), 0, (6, 6), 3, [4, 0]),  # SwiGLU fc1 bias [gate | up]
    ((4, 12), 1, None, 2, [1, 3]),  # row-parallel: TP on dim 1, data-parallel rows on dim 0
])
def test_chunks_tile_the_full_tensor(shape, dim, segments, tp_size, dp_sizes):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    rebuilt = torch.full(shape, -1.0)
    covered = torch.zeros(shape, dtype=torch.int32)
    for tp_rank in range(tp_size):
        tp = TensorParallel(None, tp_size, tp_rank)
        local = take_partition(full, tp, dim, segments)  # what the TP rank's layer holds
        layout = ModelParallel(tp_size=tp_size, tp_rank=tp_rank)
        param = torch.nn.Parameter(local.clone())
        set_tensor_model_parallel_attributes(param, True, dim, segments=segments)
        tp_slice = TensorParallelSlice.of(param, layout, "w")
        assert tp_slice.full_shape(local.shape) == shape == full_shape(param, layout, "w")
        for start, length in _row_blocks(local.shape[0], dp_sizes):
            block = local.narrow(0, start, length)
            offsets = (start,) + (0,) * (local.dim() - 1)
            for where, view in tp_slice.chunks(block, offsets):
                index = tuple(slice(o, o + n) for o, n in zip(where, view.shape))
                assert view.numel() > 0
                rebuilt[index] = view
                covered[index] += 1
    assert torch.equal(covered, torch.ones_like(covered)), covered
    assert torch.equal(rebuilt, full)


def test_chunked_tensor_gives_dcp_the_offsets_and_views():
    full = torch.arange(16.0).reshape(8, 2)
    tp = TensorParallel(None, 2, 1)
    param = torch.nn.Parameter(take_partition(full, tp, 0, (4, 2, 2)))  # rows Q[2:4], K[1:2], V[1:2]
    set_tensor_model_parallel_attributes(param, True, 0, segments=(4, 2, 2))
    value = checkpoint_value(param.detach(), param, ModelParallel(tp_size=2, tp_rank=1), "qkv")
    assert isinstance(value, ChunkedTensor) and value.shape == (8, 2)
    items = value.__create_write_items__("model.qkv", value)
    assert [tuple(i.index.offset) for i in items] == [(2, 0), (5, 0), (7, 0)]
    assert all(i.type == WriteItemType.SHARD and tuple(i.tensor_data.size) == (8, 2) for i in items)
    assert [tuple(c.sizes) for c in value.__create_chunk_list__()] == [(2, 2), (1, 2), (1, 2)]
    for item in items:
        shard = value.__get_tensor_shard__(item.index)
        start = item.index.offset[0]
        assert torch.equal(shard, full[start:start + shard.shape[0]])
        assert shard.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()  # a view: loads in place
    with pytest.raises(TypeError, match="only carries checkpoint chunks"):
        torch.add(value, 1)


def test_unsliced_values_are_unchanged():
    param = torch.nn.Parameter(torch.ones(4, 2))
    set_tensor_model_parallel_attributes(param, False, 0)  # TP-replicated (a row-parallel bias)
    assert checkpoint_value(param, param, ModelParallel(tp_size=2), "b") is param
    sliced = torch.nn.Parameter(torch.ones(4, 2))
    set_tensor_model_parallel_attributes(sliced, True, 0)
    assert checkpoint_value(sliced, sliced, ModelParallel(), "w") is sliced  # TP 1: the TP-1 entries
    step = torch.tensor(3.0)  # an optimizer state of another shape
    assert checkpoint_value(step, sliced, ModelParallel(tp_size=2), "w") is step


def test_expert_parameters_are_not_tensor_parallel_slices():
    """megatron-core marks expert weights tensor_model_parallel even with expert TP 1 (no expert tensor
    parallelism here): under dense TP2 they are whole experts, saved as they are, not gathered over TP."""
    expert = torch.nn.Parameter(torch.ones(4, 2))
    set_tensor_model_parallel_attributes(expert, True, 0)
    expert.allreduce = False  # megatron-core's mark of an expert parameter
    layout = ModelParallel(tp_size=2)
    assert not layout.is_sliced(expert)
    assert checkpoint_value(expert, expert, layout, "experts.0.w") is expert
    dense = torch.nn.Parameter(torch.ones(4, 2))
    set_tensor_model_parallel_attributes(dense, True, 0)
    assert layout.is_sliced(dense)


def test_segments_that_do_not_split_evenly_name_the_parameter():
    param = torch.nn.Parameter(torch.ones(6, 2))
    set_tensor_model_parallel_attributes(param, True, 0, segments=(8, 3, 1))
    with pytest.raises(ValueError, match="parameter layers.0.qkv.weight: partition_segments"):
        TensorParallelSlice.of(param, ModelParallel(tp_size=2), "layers.0.qkv.weight")


def test_rename():
    layout = ModelParallel(rename=lambda fqn: fqn.replace("local_experts.0", "local_experts.2"))
    assert layout.name("mlp.local_experts.0.fc1_weight") == "mlp.local_experts.2.fc1_weight"
    assert ModelParallel().name("a.b") == "a.b"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_megatron_core_partition_stride_is_equal_segments(tp_size):
    """megatron-core's gated fc1 (``partition_stride`` 2, no ``partition_segments``): rank t holds pieces t and
    t + T of the full tensor cut in 2 x T pieces (its ``_initialize_affine_weight_cpu``), [gate_t | up_t]."""
    full = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)  # [gate (8 rows) | up (8 rows)]
    pieces = full.split(16 // (2 * tp_size))
    rebuilt = torch.full_like(full, -1.0)
    for tp_rank in range(tp_size):
        param = torch.nn.Parameter(torch.cat(pieces[tp_rank::tp_size]))
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
        layout = ModelParallel(tp_size=tp_size, tp_rank=tp_rank)
        tp_slice = TensorParallelSlice.of(param, layout, "fc1")
        assert tp_slice.segments == (8, 8) and full_shape(param, layout, "fc1") == (16, 3)
        for where, view in tp_slice.chunks(param.detach(), (0, 0)):
            rebuilt[where[0]:where[0] + view.shape[0]] = view
    assert torch.equal(rebuilt, full)
    odd = torch.nn.Parameter(torch.ones(3, 2))
    odd.tensor_model_parallel, odd.partition_dim, odd.partition_stride = True, 0, 2
    with pytest.raises(ValueError, match="parameter fc1: partition_stride 2 does not divide"):
        TensorParallelSlice.of(odd, ModelParallel(tp_size=2), "fc1")


def test_staged_copy_holds_copies_at_the_same_offsets():
    full = torch.arange(16.0).reshape(8, 2)
    param = torch.nn.Parameter(take_partition(full, TensorParallel(None, 2, 1), 0, (4, 2, 2)))
    set_tensor_model_parallel_attributes(param, True, 0, segments=(4, 2, 2))
    value = checkpoint_value(param.detach(), param, ModelParallel(tp_size=2, tp_rank=1), "qkv")
    entries = {"w": value, "step": torch.tensor(3.0), "groups": [{"lr": 0.1}]}  # a flat dict of entries
    staged = {k: staged_copy(v) for k, v in entries.items()}
    copy = staged["w"]
    assert isinstance(copy, ChunkedTensor) and copy.shape == value.shape and copy.dtype == value.dtype
    assert [o for o, _ in copy.chunks] == [o for o, _ in value.chunks]
    with torch.no_grad():
        param.add_(100.0)  # training moves on: the copy keeps the values of the call
    for (_, got), (offsets, now) in zip(copy.chunks, value.chunks, strict=True):
        assert torch.equal(got + 100.0, now), offsets
        assert got.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    assert staged["step"].item() == 3.0 and staged["groups"] == [{"lr": 0.1}]

"""Layout math, no processes: offsets, padding, row alignment, zero-row pieces."""

import math
import random

import pytest

from megatron_fsdp.sharding.layout import build_flat_layout


def assert_valid(layout):
    """Every parameter is contiguous, none overlap, and every shard boundary falls between rows."""
    end = 0
    for i, slot in enumerate(layout.slots):
        assert slot.offset >= end, "parameters overlap or are out of order"
        end = slot.offset + slot.numel
        rows = 0
        for r in range(layout.world_size):
            piece = layout.piece(i, r)
            assert piece.row_start == rows or piece.row_count == 0
            if piece.row_count:
                start = slot.offset + piece.row_start * slot.row_numel
                assert start == r * layout.shard_numel + piece.shard_offset
                assert piece.shard_offset + piece.row_count * slot.row_numel <= layout.shard_numel
            rows += piece.row_count
        assert rows == slot.rows, f"rows of parameter {i} do not add up"
    assert end <= layout.total_numel


def test_even_split_has_no_padding():
    layout = build_flat_layout([(8, 4), (8,)], 2)
    assert layout.shard_numel == 20 and layout.padding_numel == 0
    assert layout.rows_per_rank(0) == (5, 3) and layout.rows_per_rank(1) == (0, 8)
    assert_valid(layout)


def test_row_never_straddles_a_boundary():
    layout = build_flat_layout([(3,), (5, 7)], 2)  # 38 elements; 19 would split a row of 7
    assert_valid(layout)
    assert layout.slots[1].offset % 1 == 0
    assert sum(layout.rows_per_rank(1)) == 5


def test_param_smaller_than_world_gives_zero_rows():
    layout = build_flat_layout([(1, 13), (10, 13)], 4)
    assert_valid(layout)
    assert sorted(layout.rows_per_rank(0)) == [0, 0, 0, 1]
    empty = [r for r in range(4) if layout.piece(0, r).row_count == 0]
    assert all(layout.piece(0, r).local_shape((1, 13)) == (0, 13) for r in empty)


def test_world_size_one_is_packed():
    layout = build_flat_layout([(3, 2), (), (5,)], 1)
    assert [s.offset for s in layout.slots] == [0, 6, 7]
    assert layout.shard_numel == 12 and layout.padding_numel == 0


def test_zero_numel_parameter():
    layout = build_flat_layout([(0, 4), (6, 4)], 2)
    assert_valid(layout)
    assert layout.rows_per_rank(0) == (0, 0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16])
def test_random_shapes(world_size):
    rng = random.Random(world_size)
    for _ in range(200):
        shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 8))]
        layout = build_flat_layout(shapes, world_size)
        assert_valid(layout)
        assert layout.shard_numel * world_size >= sum(math.prod(s) for s in shapes)


def transformer_block(h: int, ffn: int) -> list[tuple[int, ...]]:
    return [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (ffn, h), (ffn,), (h, ffn), (h,)]


# Padding is below one row-size multiple per shard (see layout.build_flat_layout), so it is
# small when a shard holds many rows: true for realistic blocks at realistic world sizes.
@pytest.mark.parametrize(
    "h,ffn,world_size", [(384, 1536, 2), (384, 1536, 8), (1024, 4096, 16), (4096, 11008, 8), (4096, 14336, 64)]
)
def test_padding_under_one_percent_on_a_transformer_block(h, ffn, world_size):
    layout = build_flat_layout(transformer_block(h, ffn), world_size)
    assert_valid(layout)
    assert layout.padding_numel / layout.param_numel < 0.01

"""Flat-buffer layout: where each parameter sits and which rows each rank owns.

Pure functions on shapes, no tensors and no processes, so the arithmetic that
every other layer trusts can be unit-tested in isolation.

Note: the invariant this file guarantees, relied on by ``param_group`` (views),
``ragged_shard`` (DTensor chunk metadata) and the checkpoint code: every
parameter is one contiguous slice of the unsharded buffer, and no shard
boundary falls inside one of its rows. A rank therefore owns whole rows
``[row_start, row_start + row_count)`` of each parameter (possibly none).
A unit may lay its parameters out in several such buffers
(``partition_for_padding``); the invariant holds in each.

Alignment: with ``align`` elements (``alignment_numel``: 16 bytes of the narrowest dtype
the buffer is held in), every parameter starts at a multiple of ``align`` and the shard
size is one, so every view, every shard and every collective's buffer starts 16-byte
aligned (what NCCL's and cuBLAS's fast paths and fused kernels asserting alignment need).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

ALIGN_BYTES = 16  # the alignment of every parameter's first element in a flat buffer


def alignment_numel(itemsizes: Iterable[int]) -> int:
    """Elements per ``ALIGN_BYTES`` of the narrowest of ``itemsizes``: an offset that is a multiple of it
    is ``ALIGN_BYTES``-aligned in a buffer of every one of those element sizes."""
    return max((max(1, ALIGN_BYTES // int(size)) for size in itemsizes), default=1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the unsharded flat buffer."""

    shape: tuple[int, ...]
    offset: int  # first element, in the unsharded flat buffer

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardPiece:
    """The rows of one parameter that one rank owns, and where they sit in its shard."""

    row_start: int
    row_count: int
    shard_offset: int  # first element, in that rank's shard

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:  # a 0-dim parameter is one row; only an unsharded layout holds it
            return ()
        return (self.row_count, *shape[1:])


@dataclass(frozen=True)
class FlatLayout:
    """Parameters laid out one after another, padded into ``world_size`` equal shards."""

    slots: tuple[ParamSlot, ...]
    world_size: int
    shard_numel: int

    @property
    def total_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self.param_numel

    def piece(self, index: int, rank: int) -> ShardPiece:
        """Rows of parameter ``index`` held by ``rank`` (row_count may be 0)."""
        slot = self.slots[index]
        if slot.numel == 0:
            # No elements, but dim 0 may still have rows ((5, 9, 0)): rank 0 holds them all,
            # so the ranks' row counts add up to the shape the DTensor reports.
            return ShardPiece(0, slot.rows, 0) if rank == 0 else ShardPiece(slot.rows, 0, 0)
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if end <= start:
            # No overlap: an empty piece positioned where the rows would begin.
            row = 0 if slot.offset >= hi else slot.rows
            return ShardPiece(row, 0, 0)
        w = slot.row_numel
        assert (start - slot.offset) % w == 0 and (end - slot.offset) % w == 0, "row split"
        return ShardPiece((start - slot.offset) // w, (end - start) // w, start - lo)

    def rows_per_rank(self, index: int) -> tuple[int, ...]:
        """Every rank's row count of parameter ``index`` (what its ``RaggedShard`` records).

        Only the ranks the parameter overlaps are visited, so one unit costs
        O(parameters + ranks), not O(parameters x ranks) (docs/scale.md).
        """
        slot, n = self.slots[index], self.shard_numel
        if slot.numel == 0:  # rows without elements: all on rank 0 (see ``piece``)
            return (slot.rows,) + (0,) * (self.world_size - 1)
        first, last = slot.offset // n, (slot.offset + slot.numel - 1) // n
        if first == last:
            held: tuple[int, ...] = (slot.rows,)
        else:
            # Ranks strictly between the first and the last hold a whole shard of rows.
            full = n // slot.row_numel
            assert last - first < 2 or full * slot.row_numel == n, "row split"
            head, tail = self.piece(index, first).row_count, self.piece(index, last).row_count
            held = (head,) + (full,) * (last - first - 1) + (tail,)
        return (0,) * first + held + (0,) * (self.world_size - 1 - last)


def _place(shapes: list[tuple[int, ...]], shard_numel: int, world_size: int, align: int) -> list[int] | None:
    """Greedy placement for one shard size (a multiple of ``align``); None when it does not fit."""
    offsets: list[int] = []
    cursor = 0
    for shape in shapes:
        slot = ParamSlot(shape, 0)
        numel, w = slot.numel, slot.row_numel
        if numel == 0:
            offsets.append(cursor)
            continue
        cursor = _round_up(cursor, align)
        boundary = (cursor // shard_numel + 1) * shard_numel
        if cursor + numel > boundary and w > 1:  # one-element rows: every boundary falls between two
            # Crosses a boundary: shift so that the boundary falls between rows. Both the
            # cursor and the boundary are multiples of align, so a shift by a multiple of
            # lcm(w, align) keeps the start aligned and the boundary between rows.
            start = cursor + (boundary - cursor) % math.lcm(w, align)
            if start + numel > boundary + shard_numel and shard_numel % w:
                # Spans two boundaries with a row size that does not divide the
                # shard: only a start on the boundary itself can still work.
                start = boundary
                if numel > shard_numel:
                    return None
            cursor = start
        offsets.append(cursor)
        cursor += numel
    return offsets if cursor <= shard_numel * world_size else None


def build_flat_layout(shapes: list[tuple[int, ...]], world_size: int, align: int = 1) -> FlatLayout:
    """Lay out parameters of the given shapes for ``world_size`` equal shards.

    The shard size starts at the even split and grows (in steps that keep every
    large parameter's row size and ``align`` divisors of it) until the row-aligned
    greedy placement fits; padding is therefore below one row (or ``align``
    elements) per shard boundary and below ``align`` per parameter for ordinary
    transformer shapes. Every parameter with elements starts at a multiple of ``align``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    total = sum(math.prod(s) for s in shapes)
    if world_size == 1 or total == 0:
        offsets, cursor = [], 0
        for s in shapes:
            if math.prod(s):
                cursor = _round_up(cursor, align)
            offsets.append(cursor)
            cursor += math.prod(s)
        slots = tuple(ParamSlot(s, o) for s, o in zip(shapes, offsets))
        return FlatLayout(slots, world_size, max(cursor, 0) if world_size == 1 else 0)
    lower = -(-total // world_size)
    if lower < align and all(ParamSlot(sh, 0).row_numel == 1 for sh in shapes):
        # Each rank's part of a buffer of biases and norms would be under 16 bytes: rounding it up to 16
        # would store up to 4x (a bias over 1,024 ranks: 4 elements per rank where FSDP2 stores 1), and a
        # part that small gains nothing from an aligned start. Parameters still start aligned, and with rows
        # of one element any shard boundary falls between rows.
        shard = lower
        while (offsets := _place(shapes, shard, world_size, align)) is None:
            shard += 1  # the parameters' aligned starts leave gaps: a little more per rank
        return _layout(shapes, offsets, world_size, shard)
    # Parameters larger than a shard may span several boundaries; their row
    # sizes must then divide the shard size.
    step = align
    for s in shapes:
        if math.prod(s) > lower:
            step = math.lcm(step, ParamSlot(s, 0).row_numel)
    if step > lower:
        step = align  # pathological row sizes: the search below still terminates
    shard = -(-lower // step) * step
    while True:
        offsets = _place(shapes, shard, world_size, align)
        if offsets is not None:
            return _layout(shapes, offsets, world_size, shard)
        shard += step


def _layout(shapes: list[tuple[int, ...]], offsets: list[int], world_size: int, shard: int) -> FlatLayout:
    return FlatLayout(tuple(ParamSlot(s, o) for s, o in zip(shapes, offsets)), world_size, shard)


# A unit is split into several flat buffers (one collective each) when that saves at least
# this many padding elements and 1% of the unit: below that, the latency of an extra
# collective costs more than the bytes it saves. It is also split whenever the fewer
# buffers would pad more than FSDP2's per-parameter ``Shard(0)`` layout of the same shapes
# by more than ``FSDP2_PADDING_SLACK_NUMEL``: storage at or below FSDP2's is a promise
# (docs/scale.md), and only an excess below 16 KiB (fp32) per unit is left to latency.
SPLIT_MIN_SAVING_NUMEL = 1 << 16
SPLIT_MIN_SAVING_FRACTION = 0.01
FSDP2_PADDING_SLACK_NUMEL = 1 << 12


def fsdp2_padding_numel(shapes: list[tuple[int, ...]], world_size: int) -> int:
    """The padding FSDP2 stores for these shapes: each parameter's dim 0 rounded up to ``world_size`` rows."""
    return sum((-(-s[0] // world_size) * world_size - s[0]) * math.prod(s[1:]) for s in shapes if len(s))


def _padding(shapes: list[tuple[int, ...]], parts: list[list[int]], world_size: int, align: int) -> int:
    return sum(build_flat_layout([shapes[i] for i in part], world_size, align).padding_numel for part in parts)


def partition_for_padding(shapes: list[tuple[int, ...]], world_size: int, align: int = 1) -> list[list[int]]:
    """Indices of ``shapes`` split into the flat buffers a unit lays its parameters out in.

    One buffer's shard size must be a multiple of the row size of every
    parameter that spans two of its boundaries, so a unit whose large
    parameters have different row sizes (a Llama layer: 4096 and 14336) pads
    each shard up to a multiple of their lcm (7.7% at 1,024 ranks for 8B).
    Parameters of one row size share a buffer with no such loss: their rows
    pool, and each shard holds ``ceil(rows / world_size)`` of them. So the candidates
    group the large parameters (more elements than one shard of the single buffer),
    or every parameter of two or more dimensions, by row size, in registration order;
    the rest (norms, biases) either get their own buffer or join one group. They are
    tried fewest buffers first, then least padding.

    The split is taken when it saves ``SPLIT_MIN_SAVING_NUMEL`` elements and
    ``SPLIT_MIN_SAVING_FRACTION`` of the unit over the option with fewer buffers, or
    when that option pads more than FSDP2 would (``fsdp2_padding_numel``) by over
    ``FSDP2_PADDING_SLACK_NUMEL`` elements; so small models (and every unit with
    nothing to gain) keep one buffer, and no unit stores measurably more than FSDP2.
    Deterministic in ``shapes`` and ``world_size``: every rank splits alike.
    """
    everything = [list(range(len(shapes)))]
    total = sum(math.prod(s) for s in shapes)
    if world_size == 1 or total == 0 or len(shapes) < 2:
        return everything
    lower = -(-total // world_size)
    candidates = [everything]
    # Two groupings by row size: of the large parameters only (more elements than one shard,
    # the ones whose row size constrains the shard), and of every parameter of two or more
    # dimensions (a small one of a class's row size, like k_proj beside q_proj, pools with it).
    for is_grouped in (lambda s: math.prod(s) > lower and len(s) > 1, lambda s: len(s) > 1):
        by_row: dict[int, list[int]] = {}
        small: list[int] = []
        for i, s in enumerate(shapes):
            if is_grouped(s):
                by_row.setdefault(math.prod(s[1:]), []).append(i)
            else:
                small.append(i)
        classes = list(by_row.values())
        if not classes:
            continue
        for c in range(len(classes)):  # the small parameters join one class
            candidates.append([part + small if j == c else part for j, part in enumerate(classes)])
        if small:
            candidates.append(classes + [small])
    scored = sorted(((len(parts), _padding(shapes, parts, world_size, align), n), parts)
                    for n, parts in enumerate(candidates))  # fewest buffers first, then least padding
    fsdp2_bound = fsdp2_padding_numel(shapes, world_size) + FSDP2_PADDING_SLACK_NUMEL
    best, best_padding = everything, _padding(shapes, everything, world_size, align)
    for (buffers, padding, _), parts in scored:
        saving = best_padding - padding
        more = buffers > len(best)
        worth_a_collective = saving >= SPLIT_MIN_SAVING_NUMEL and saving >= SPLIT_MIN_SAVING_FRACTION * total
        if saving > 0 and (not more or worth_a_collective or best_padding > fsdp2_bound):
            best, best_padding = parts, padding
    return best

"""Per-rank memory and bytes per step of a model under a strategy, from the engine's own layout arithmetic.

Everything here is computed with ``sharding.layout`` (``partition_for_padding``,
``build_flat_layout``), the functions ``fully_shard`` and ``ParamGroup`` lay flat
buffers out with, so the figures are the engine's, not an approximation: ``benchmarks/simulate_scale.py`` runs the
engine on one rank of a fake N-rank job and checks them
(``tests/unit/sharding/test_scale_simulation.py``). Assumed: every parameter of a unit of
one dtype and trainable (one parameter kind, split into flat buffers as
``fully_shard`` splits it: ``layout.partition_for_padding``), a torch Adam/AdamW
(two state tensors of the main dtype per parameter element this rank holds), and
gradients kept until ``zero_grad``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from megatron_fsdp.plan.models import UnitShape
from megatron_fsdp.sharding.layout import FlatLayout, alignment_numel, build_flat_layout, partition_for_padding
from megatron_fsdp.sharding.strategy import ShardingPlan, resolve_strategy

ADAM_STATES = 2  # exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the compute (gathered) weights, the main weights/optimizer state, and gradients."""

    compute: int = 4
    main: int = 4
    grad: int = 4

    @staticmethod
    def named(name: str) -> Precision:
        """``fp32`` (no mixed precision) or ``bf16`` (bf16 compute and gradient communication, fp32 main)."""
        if name == "fp32":
            return Precision(4, 4, 4)
        if name == "bf16":
            return Precision(2, 4, 4)
        raise ValueError(f"unknown precision {name!r}; known: fp32, bf16")


@dataclass(frozen=True)
class UnitPlan:
    """One unit kind (``count`` identical units): its flat buffers laid out for ``pieces`` main shards.

    Usually one buffer; several where ``layout.partition_for_padding`` splits the unit.
    """

    unit: UnitShape
    layouts: tuple[FlatLayout, ...]

    @property
    def shard_numel(self) -> int:
        return sum(layout.shard_numel for layout in self.layouts)

    @property
    def total_numel(self) -> int:
        """Elements of the unit's unsharded buffers, padding included (what one all-gather moves)."""
        return sum(layout.total_numel for layout in self.layouts)

    @property
    def padding_numel(self) -> int:
        return sum(layout.padding_numel for layout in self.layouts)

    @property
    def padding_fraction(self) -> float:
        """Padding over the unit's parameter elements (the same fraction of every collective on it)."""
        return self.padding_numel / max(self.unit.numel, 1)

    def local_param_numel(self, rank: int) -> int:
        """Parameter elements (padding excluded) of main-shard ``rank``: what the optimizer's state covers."""
        return sum(
            layout.piece(i, rank).row_count * slot.row_numel
            for layout in self.layouts
            for i, slot in enumerate(layout.slots)
        )


@dataclass(frozen=True)
class RankPlan:
    """One rank's memory (bytes) and bytes per training step, with the analytic ZeRO figures beside them."""

    strategy: ShardingPlan
    world: int
    outer: int
    pieces: int  # main shards the layout is cut into (the optimizer's world)
    units: tuple[UnitPlan, ...]
    precision: Precision
    rank: int

    @property
    def param_numel(self) -> int:
        return sum(u.unit.numel * u.unit.count for u in self.units)

    @property
    def buffer_numel(self) -> int:
        """Elements of every unit's unsharded flat buffer, padding included."""
        return sum(u.total_numel * u.unit.count for u in self.units)

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's main shards (padding included)."""
        return sum(u.shard_numel * u.unit.count for u in self.units)

    @property
    def local_param_numel(self) -> int:
        return sum(u.local_param_numel(self.rank) * u.unit.count for u in self.units)

    # -- memory (bytes) ------------------------------------------------------
    @property
    def main_params(self) -> int:
        return self.shard_numel * self.precision.main

    @property
    def compute_shards(self) -> int:
        """Extra compute-dtype shards (mixed precision, or HSDP outer 'optim': the dp_shard-sized shard)."""
        if self.outer > 1 and self.pieces > self.world // self.outer:
            return self.shard_numel * self.outer * self.precision.compute
        return 0 if self.precision.compute == self.precision.main else self.shard_numel * self.precision.compute

    @property
    def grads(self) -> int:
        """Reduced gradients kept until zero_grad: this rank's shard, or the whole buffer (no_shard, optim)."""
        numel = self.shard_numel if self.strategy.grads else self.buffer_numel
        return numel * self.precision.main

    @property
    def optimizer_state(self) -> int:
        return ADAM_STATES * self.local_param_numel * self.precision.main

    @property
    def resident(self) -> int:
        """Between steps: main and compute shards, gradients, optimizer state."""
        return self.main_params + self.compute_shards + self.grads + self.optimizer_state

    @property
    def gathered_weights(self) -> int:
        """Unsharded weights alive during forward/backward: every unit (no_shard, ZeRO-1/2) or the largest (ZeRO-3)."""
        if not self.strategy.optim:
            return 0  # the main weights are the full ones, counted in main_params
        if self.strategy.params:
            return max(u.total_numel for u in self.units) * self.precision.compute
        return self.buffer_numel * self.precision.compute

    @property
    def largest_transient(self) -> int:
        """The largest unit's gathered weights plus its full-size gradient buffer (one unit's backward)."""
        largest = max(u.total_numel for u in self.units)
        gathered = largest * self.precision.compute if self.strategy.optim else 0
        return gathered + largest * self.precision.grad

    # -- analytic ZeRO figures (no padding) ----------------------------------
    def zero_main_params(self) -> float:
        return self.param_numel / self.pieces * self.precision.main

    def zero_grads(self) -> float:
        return (self.param_numel / self.pieces if self.strategy.grads else self.param_numel) * self.precision.main

    def zero_optimizer_state(self) -> float:
        return ADAM_STATES * self.param_numel / self.pieces * self.precision.main

    # -- collectives per step (CommStats' convention: bytes of the buffer each call moves) --
    def step_bytes(self, padded: bool = True) -> dict[str, int]:
        """Bytes per forward+backward by collective kind; ``padded=False`` gives the ZeRO minimum.

        Control rounds (a few bytes per unit) are left out.
        """
        out: dict[str, int] = defaultdict(int)
        inner = self.world // self.outer
        outer_optim = self.pieces > inner
        p = self.precision
        for u in self.units:
            full = (u.total_numel if padded else u.unit.numel) * u.unit.count
            piece = (u.shard_numel if padded else u.unit.numel / self.pieces) * u.unit.count
            if self.strategy.optim and inner > 1:
                # ZeRO-3 gathers again for backward, except the root, which stays gathered after forward.
                gathers = 2 if self.strategy.params and not u.unit.is_root else 1
                out["all_gather"] += gathers * full * p.compute
            if outer_optim:  # the compute shard rebuilt across dp_outer, once per step
                out["all_gather_outer"] += piece * self.outer * p.compute
            if self.strategy.grads:
                if inner > 1:
                    out["reduce_scatter"] += full * p.grad
                if outer_optim:
                    out["reduce_scatter_outer"] += piece * self.outer * p.grad
                elif self.outer > 1:
                    out["all_reduce"] += piece * p.grad
            elif self.world > 1:
                out["all_reduce"] += full * p.grad
        return {k: int(v) for k, v in out.items()}


def _layouts(shapes: list[tuple[int, ...]], pieces: int, align: int) -> tuple[FlatLayout, ...]:
    """The unit's flat buffers, split and 16-byte aligned as ``fully_shard`` lays them out."""
    parts = partition_for_padding(shapes, pieces, align)
    return tuple(build_flat_layout([shapes[i] for i in part], pieces, align) for part in parts)


def plan_rank(
    units: list[UnitShape],
    world: int,
    strategy: str | int | ShardingPlan = "optim_grads_params",
    *,
    outer: int = 1,
    outer_optim: bool = False,
    precision: Precision | None = None,
    rank: int = 0,
) -> RankPlan:
    """Lay out every unit as the engine would for ``world`` ranks (``outer`` replicas of ``world // outer``)."""
    plan = resolve_strategy(strategy)
    if world < 1 or outer < 1 or world % outer:
        raise ValueError(f"world={world} must be a positive multiple of outer={outer}")
    if outer_optim and not plan.grads:
        raise ValueError(f"outer_optim needs a strategy that shards gradients, got {plan.name!r}")
    inner = world // outer
    pieces = (inner * outer if outer_optim and outer > 1 else inner) if plan.optim else 1
    if not 0 <= rank < pieces:
        raise ValueError(f"rank={rank} is not one of the {pieces} main shards")
    precision = precision or Precision()
    align = alignment_numel((precision.compute, precision.main, precision.grad))
    laid = tuple(UnitPlan(u, _layouts(u.shapes, pieces, align)) for u in units)
    return RankPlan(plan, world, outer, pieces, laid, precision, rank)


def fsdp2_padded_numel(shapes: list[tuple[int, ...]], world: int) -> int:
    """Elements FSDP2's per-parameter ``Shard(0)`` holds over all ranks (each dim 0 padded to a multiple of world)."""
    return sum(-(-s[0] // world) * world * math.prod(s[1:]) if s else world for s in shapes)

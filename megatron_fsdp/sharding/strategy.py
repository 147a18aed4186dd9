"""Sharding strategies as data: the one table of strategy names (docs/design.md section 1).

The engine never compares strategy strings: it reads a ``ShardingPlan`` that
says, per role, whether that role is sharded over the data-parallel group.
User-facing names (Megatron's, and ZeRO stage numbers) are translated here
once, at the API edge. Every other place that lists strategy names (the DDP
config, the mesh, the whole-model API, the front-end's flags) imports them from
here: ``STRATEGY_NAMES`` within the shard group, ``OUTER_STRATEGY_NAMES`` across
the HSDP outer dimension.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingPlan:
    """Which roles are sharded over the data-parallel (shard) group.

    - ``params``: model weights are released between uses (ZeRO-3); otherwise
      they stay unsharded from the first forward until the end of backward.
    - ``grads``: gradients are reduce-scattered into shards; otherwise
      all-reduced into a full-size buffer.
    - ``optim``: main weights and optimizer state are sharded; otherwise every
      rank holds and updates all of them.
    """

    name: str
    params: bool
    grads: bool
    optim: bool

    def __post_init__(self) -> None:
        if self.params and not self.grads or self.grads and not self.optim:
            raise ValueError(f"inconsistent sharding plan {self}")


STRATEGIES: dict[str, ShardingPlan] = {
    p.name: p
    for p in (
        ShardingPlan("no_shard", params=False, grads=False, optim=False),
        ShardingPlan("optim", params=False, grads=False, optim=True),
        ShardingPlan("optim_grads", params=False, grads=True, optim=True),
        ShardingPlan("optim_grads_params", params=True, grads=True, optim=True),
    )
}
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)
ZERO_STAGES: dict[int, str] = dict(enumerate(STRATEGY_NAMES))  # ZeRO stage 0-3 -> strategy name

# Across the HSDP outer dimension: replicate, or also shard main weights, gradients and optimizer state.
OUTER_STRATEGY_NAMES: tuple[str, ...] = ("no_shard", "optim")
OUTER_ZERO_STAGES: dict[int, str] = dict(enumerate(OUTER_STRATEGY_NAMES))


def resolve_strategy(strategy: str | int | ShardingPlan, *, argument: str = "sharding_strategy") -> ShardingPlan:
    """Translate a strategy name, ZeRO stage (0-3) or plan into a ``ShardingPlan``."""
    if isinstance(strategy, ShardingPlan):
        return strategy
    if isinstance(strategy, int) and not isinstance(strategy, bool) and strategy in ZERO_STAGES:
        return STRATEGIES[ZERO_STAGES[strategy]]
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return STRATEGIES[strategy]
    valid = ", ".join(repr(n) for n in STRATEGIES)
    raise ValueError(f"{argument}={strategy!r} is not a sharding strategy; valid: {valid} (or ZeRO stage 0-3)")

"""Sharding strategies as data (DESIGN.md §5).

The engine never compares strategy strings: it reads a ``ShardingPlan`` that
says, per role, whether that role is sharded over the data-parallel group.
User-facing names (Megatron's, and ZeRO stage numbers) are translated here
once, at the API edge.
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
_ZERO_STAGES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def resolve_strategy(strategy: str | int | ShardingPlan, *, argument: str = "sharding_strategy") -> ShardingPlan:
    """Translate a strategy name, ZeRO stage (0-3) or plan into a ``ShardingPlan``."""
    if isinstance(strategy, ShardingPlan):
        return strategy
    if isinstance(strategy, int) and not isinstance(strategy, bool) and strategy in _ZERO_STAGES:
        return STRATEGIES[_ZERO_STAGES[strategy]]
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return STRATEGIES[strategy]
    valid = ", ".join(repr(n) for n in STRATEGIES)
    raise ValueError(f"{argument}={strategy!r} is not a sharding strategy; valid: {valid} (or ZeRO stage 0-3)")

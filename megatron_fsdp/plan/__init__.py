"""Sizing a job before running it: per-rank memory and bytes per step from the engine's layout arithmetic.

``python -m megatron_fsdp.plan --model llama3-70b --world 1024 --strategy optim_grads_params``
prints what one rank holds. ``models`` describes model shapes (units of named
parameter shapes), ``estimate`` lays them out with ``sharding.layout`` exactly as
``ParamGroup`` does. Imports ``sharding`` only; nothing in the engine imports it.
"""

from megatron_fsdp.plan.estimate import (
    Precision,
    RankPlan,
    UnitPlan,
    fsdp2_padded_numel,
    plan_rank,
)
from megatron_fsdp.plan.models import MODELS, LlamaConfig, MLPConfig, UnitShape, model_named

__all__ = [
    "MODELS",
    "LlamaConfig",
    "MLPConfig",
    "Precision",
    "RankPlan",
    "UnitPlan",
    "UnitShape",
    "fsdp2_padded_numel",
    "model_named",
    "plan_rank",
]

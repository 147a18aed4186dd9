"""megatron_fsdp: fully-sharded data parallelism (ZeRO-1/2/3) for PyTorch and Megatron.

Public API (see docs/api.md)::

    from megatron_fsdp import fully_shard, FSDPModule
"""

from .collectives import comm_stats
from .fully_shard import fully_shard
from .grad_scaling import GradScaling
from .init import materialize_meta
from .microbatch import microbatch
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule
from .no_shard import fsdp_no_shard
from .ragged_shard import RaggedShard, full_tensor
from .strategy import STRATEGIES, ShardingPlan

__all__ = [
    "FSDPModule",
    "GradScaling",
    "MixedPrecisionPolicy",
    "RaggedShard",
    "STRATEGIES",
    "ShardingPlan",
    "comm_stats",
    "fsdp_no_shard",
    "full_tensor",
    "fully_shard",
    "materialize_meta",
    "microbatch",
]
__version__ = "0.1.0"

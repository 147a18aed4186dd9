"""megatron_fsdp: fully-sharded data parallelism (ZeRO-1/2/3) for PyTorch and Megatron.

Public API (see docs/api.md)::

    from megatron_fsdp import fully_shard, FSDPModule
"""

from .collectives import comm_stats
from .fully_shard import fully_shard
from .module import FSDPModule
from .ragged_shard import RaggedShard, full_tensor
from .strategy import STRATEGIES, ShardingPlan

__all__ = ["FSDPModule", "RaggedShard", "STRATEGIES", "ShardingPlan", "comm_stats", "full_tensor", "fully_shard"]
__version__ = "0.1.0"

"""megatron_fsdp: fully-sharded data parallelism (ZeRO-1/2/3, HSDP) for PyTorch and Megatron.

Public API (see docs/api.md, docs/whole_model_api.md, docs/checkpointing.md)::

    from megatron_fsdp import fully_shard, fully_shard_model, fully_shard_optimizer, MegatronFSDP
    from megatron_fsdp import save_checkpoint, load_checkpoint
    from megatron_fsdp.mcore import FullyShardedDataParallel   # the Megatron-Core adapter
"""

from .checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from .checkpoint_export import export_full_state_dict, import_full_state_dict
from .checkpoint_io import load_state, save_state
from .checkpoint_state import CheckpointMismatchError
from .collectives import comm_stats
from .config import DistributedDataParallelConfig
from .fully_shard import fully_shard
from .fully_shard_model import MegatronPrecisionPolicy, fully_shard_model
from .grad_norm import clip_grad_norm_, get_grad_norm
from .grad_scaling import GradScaling
from .init import materialize_meta
from .megatron_fsdp import MegatronFSDP
from .microbatch import microbatch
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule
from .no_shard import fsdp_no_shard
from .optimizer import fully_shard_optimizer
from .ragged_shard import RaggedShard, full_tensor
from .strategy import STRATEGIES, ShardingPlan

__all__ = [
    "STRATEGIES",
    "CheckpointMismatchError",
    "DistributedDataParallelConfig",
    "FSDPModule",
    "GradScaling",
    "LoadedCheckpoint",
    "MegatronFSDP",
    "MegatronPrecisionPolicy",
    "MixedPrecisionPolicy",
    "RaggedShard",
    "ShardingPlan",
    "clip_grad_norm_",
    "comm_stats",
    "export_full_state_dict",
    "fsdp_no_shard",
    "full_tensor",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "get_grad_norm",
    "import_full_state_dict",
    "load_checkpoint",
    "load_state",
    "materialize_meta",
    "microbatch",
    "save_checkpoint",
    "save_state",
]
__version__ = "0.1.0"

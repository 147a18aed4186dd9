"""megatron_fsdp: fully-sharded data parallelism (ZeRO-1/2/3, HSDP) for PyTorch and Megatron.

Public API (see docs/api.md, docs/whole_model_api.md, docs/checkpointing.md)::

    from megatron_fsdp import fully_shard, fully_shard_model, fully_shard_optimizer, MegatronFSDP
    from megatron_fsdp import save_checkpoint, load_checkpoint
    from megatron_fsdp.mcore import FullyShardedDataParallel   # the Megatron-Core adapter
"""

import importlib

from megatron_fsdp.api.config import DistributedDataParallelConfig
from megatron_fsdp.api.fully_shard_model import MegatronPrecisionPolicy, fully_shard_model
from megatron_fsdp.api.megatron_fsdp import MegatronFSDP
from megatron_fsdp.comm.collectives import CommStats, comm_stats
from megatron_fsdp.core.grad_scaling import GradScaling
from megatron_fsdp.core.meta_init import materialize_meta
from megatron_fsdp.core.microbatch import microbatch
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from megatron_fsdp.core.options import EngineOptions
from megatron_fsdp.fully_shard import fully_shard
from megatron_fsdp.optim.grad_norm import clip_grad_norm_, get_grad_norm
from megatron_fsdp.optim.optimizer import fully_shard_optimizer
from megatron_fsdp.sharding.no_shard import fsdp_no_shard
from megatron_fsdp.sharding.ragged_shard import RaggedShard, full_tensor
from megatron_fsdp.sharding.strategy import STRATEGIES, ShardingPlan

__all__ = [
    "STRATEGIES",
    "CPUOffloadPolicy",
    "CheckpointMismatchError",
    "CommStats",
    "DistributedDataParallelConfig",
    "EngineOptions",
    "FSDPModule",
    "GradScaling",
    "LoadedCheckpoint",
    "MegatronFSDP",
    "MegatronPrecisionPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "RaggedShard",
    "ShardingPlan",
    "UnshardHandle",
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
    "register_fsdp_forward_method",
    "save_checkpoint",
    "save_state",
]
__version__ = "0.1.0"

# The checkpoint names load torch.distributed.checkpoint (about 6 MB resident) on first use,
# not on ``import megatron_fsdp``: module-level ``__getattr__`` (PEP 562) imports their module
# when one is first read, ``from megatron_fsdp import save_checkpoint`` included. FSDP2's
# offload policies, re-exported, likewise load torch.distributed.fsdp (core/fsdp2_classes.py).
_LAZY = {
    "CPUOffloadPolicy": "torch.distributed.fsdp",
    "OffloadPolicy": "torch.distributed.fsdp",
    "CheckpointMismatchError": "megatron_fsdp.checkpoint.state_dicts",
    "LoadedCheckpoint": "megatron_fsdp.checkpoint.iterations",
    "export_full_state_dict": "megatron_fsdp.checkpoint.export",
    "import_full_state_dict": "megatron_fsdp.checkpoint.export",
    "load_checkpoint": "megatron_fsdp.checkpoint.iterations",
    "load_state": "megatron_fsdp.checkpoint.sharded_io",
    "save_checkpoint": "megatron_fsdp.checkpoint.iterations",
    "save_state": "megatron_fsdp.checkpoint.sharded_io",
}


def __getattr__(name: str) -> object:
    """Import a lazily re-exported name's module on first access (``_LAZY``)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

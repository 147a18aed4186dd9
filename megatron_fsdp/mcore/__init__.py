"""The Megatron-Core adapter: ``FullyShardedDataParallel`` where Megatron puts its DDP wrapper.

megatron-core is optional: it is imported lazily, only here, and only to
accept its config objects and subclass its data-parallel base class.
"""

from megatron_fsdp.mcore.fully_sharded_data_parallel import FullyShardedDataParallel, default_unit_modules

__all__ = ["FullyShardedDataParallel", "default_unit_modules"]

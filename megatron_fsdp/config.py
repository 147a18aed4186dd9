"""``DistributedDataParallelConfig``: megatron-core's data-parallel config, field for field.

The Megatron adapter (``megatron_fsdp.mcore``) reads these fields with
megatron-core's names and defaults. When megatron-core is installed its own
``DistributedDataParallelConfig`` objects are accepted as they are; this copy
lets the adapter and the ``pretrain_gpt.py`` front-end run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel options, with megatron-core's field names and defaults."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False  # megatron-core's deprecated name for use_megatron_fsdp
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        validate_ddp_config(self)


def validate_ddp_config(config: object) -> None:
    """Reject values no data-parallel wrapper could honour; name the field at fault.

    Works on this class and on megatron-core's (read by attribute name).
    """
    strategy = getattr(config, "data_parallel_sharding_strategy", "no_shard")
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(
            f"DistributedDataParallelConfig.data_parallel_sharding_strategy={strategy!r} is not valid; "
            f"use one of {SHARDING_STRATEGIES}"
        )
    outer = getattr(config, "outer_dp_sharding_strategy", "no_shard")
    if outer not in OUTER_SHARDING_STRATEGIES:
        raise ValueError(
            f"DistributedDataParallelConfig.outer_dp_sharding_strategy={outer!r} is not valid; "
            f"use one of {OUTER_SHARDING_STRATEGIES}"
        )
    instances = getattr(config, "num_distributed_optimizer_instances", 1)
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise ValueError(
            "DistributedDataParallelConfig.num_distributed_optimizer_instances must be a positive int, "
            f"got {instances!r}"
        )
    for name in ("bucket_size", "suggested_communication_unit_size"):
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"DistributedDataParallelConfig.{name} must be a positive int or None, got {value!r}")

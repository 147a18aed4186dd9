"""``DistributedDataParallelConfig``: megatron-core's data-parallel config, field for field.

The Megatron adapter (``megatron_fsdp.mcore``) reads these fields with
megatron-core's names and defaults. When megatron-core is installed its own
``DistributedDataParallelConfig`` objects are accepted as they are; this copy
lets the adapter and the ``pretrain_gpt.py`` front-end run without it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

from megatron_fsdp.sharding.strategy import OUTER_STRATEGY_NAMES, STRATEGY_NAMES

SHARDING_STRATEGIES = STRATEGY_NAMES
OUTER_SHARDING_STRATEGIES = OUTER_STRATEGY_NAMES


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
    # Megatron-FSDP's FP8 parameters (its README): ZeRO-3 only; the transpose cache and the MXFP8
    # gather-buffer reuse exist only for them. Checked before any "rejected" status: a combination
    # Megatron-FSDP itself refuses is an error whatever this engine supports.
    if getattr(config, "fp8_param_gather", False) and strategy != "optim_grads_params":
        raise ValueError(
            "DistributedDataParallelConfig.fp8_param_gather=True needs data_parallel_sharding_strategy="
            f"'optim_grads_params' (FP8 parameters are ZeRO-3 only in Megatron-FSDP), got {strategy!r}"
        )
    for name in ("keep_fp8_transpose_cache", "reuse_grad_buf_for_mxfp8_param_ag"):
        if getattr(config, name, False) and not getattr(config, "fp8_param_gather", False):
            raise ValueError(
                f"DistributedDataParallelConfig.{name}=True applies to FP8 parameters only: it needs "
                "fp8_param_gather=True"
            )


# What the Megatron adapter (megatron_fsdp.mcore.FullyShardedDataParallel) does with each field.
# Status words as in docs/options.md: "mapped" (passed to an engine feature), "validated" (checked; the
# engine derives what it needs), "rejected" (a value other than the default raises NotImplementedError),
# "no effect" (accepted for megatron-core compatibility; a value away from the default warns, saying why).
DDP_CONFIG_STATUS: dict[str, tuple[str, str]] = {
    "grad_reduce_in_fp32": ("mapped", "fully_shard_model(grad_reduce_in_fp32=...): the reduction dtype"),
    "overlap_grad_reduce": ("mapped", "fully_shard_model(overlap_grad_reduce=...): reductions in flight"),
    "overlap_param_gather": ("mapped", "fully_shard_model(overlap_param_gather=...): all-gather prefetch"),
    "align_param_gather": (
        "no effect",
        "it makes all pipeline stages issue their deferred parameter all-gathers together; here each unit's "
        "all-gather is issued by its own forward (prefetched one unit ahead), never deferred, so there is "
        "nothing to align. Megatron-LM turns it on by default, so True does not warn",
    ),
    "use_distributed_optimizer": (
        "validated",
        "data_parallel_sharding_strategy decides where optimizer state lives (sharded for optim, optim_grads, "
        "optim_grads_params); True with no_shard warns, since the optimizer state stays replicated",
    ),
    "num_distributed_optimizer_instances": ("mapped", "HSDP: a (dp_outer, dp_shard) mesh with this many replicas"),
    "check_for_nan_in_grad": ("mapped", "fully_shard_model(check_for_nan_in_grad=...)"),
    "check_for_large_grads": ("rejected", "the large-gradient check is not implemented; use check_for_nan_in_grad"),
    "bucket_size": (
        "no effect",
        "gradients are reduced one flat buffer per FSDP unit (the units are the communication buckets); "
        "choose the units with fsdp_unit_modules instead",
    ),
    "pad_buckets_for_high_nccl_busbw": (
        "no effect",
        "each unit's flat buffer is already padded to equal, row-aligned shards for its collectives; no "
        "further padding for NCCL bus bandwidth is applied",
    ),
    "reduce_scatter_with_fp32_accumulation": (
        "rejected", "fp32 accumulation inside the reduce-scatter is not implemented; use grad_reduce_in_fp32=True",
    ),
    "average_in_collective": ("mapped", "fully_shard_model(average_in_collective=...)"),
    "fp8_param_gather": (
        "rejected",
        "FP8 parameter all-gather needs TransformerEngine FP8 parameters, whose gather is not built (their FSDP2 "
        "hooks read PyTorch FSDP2's private module state; docs/mixed_precision.md). For a float8 weight all-gather "
        "use MixedPrecisionPolicy(gather_format='mxfp8') or gather_dtype, or torchao's float8 training",
    ),
    "reuse_grad_buf_for_mxfp8_param_ag": (
        "rejected", "MXFP8 parameter all-gather needs TransformerEngine (not supported)",
    ),
    "use_megatron_fsdp": ("validated", "must be True (or use_custom_fsdp): FullyShardedDataParallel is Megatron-FSDP"),
    "use_custom_fsdp": ("validated", "megatron-core's deprecated name for use_megatron_fsdp"),
    "data_parallel_sharding_strategy": ("mapped", "fully_shard_model(zero_dp_strategy=...)"),
    "gradient_reduce_div_fusion": (
        "no effect",
        "gradients are always divided before a SUM collective (bitwise DDP's numbers on gloo and NCCL); "
        "there is no separate division to fuse, so both values reduce the same way",
    ),
    "suggested_communication_unit_size": (
        "no effect",
        "it sizes the batches in which Megatron-FSDP groups buckets for one collective; here each FSDP unit is "
        "one collective, so choose the units with fsdp_unit_modules instead",
    ),
    "preserve_fp32_weights": ("mapped", "fully_shard_model(preserve_fp32_weights=...): fp32 main weights"),
    "keep_fp8_transpose_cache": ("rejected", "FP8 transpose caches need TransformerEngine FP8 parameters"),
    "nccl_ub": (
        "rejected",
        "NCCL user-buffer registration needs persistent registered communication buffers; this engine allocates "
        "its all-gather/reduce-scatter buffers per use (see fully_shard_model(nccl_ub=True))",
    ),
    "fsdp_double_buffer": (
        "rejected", "persistent double buffers serve nccl_ub, which is not implemented; memory is bounded by the "
        "all-gather prefetch depth instead",
    ),
    "outer_dp_sharding_strategy": ("mapped", "fully_shard_model(outer_dp_sharding_strategy=...) under HSDP"),
    "disable_symmetric_registration": ("rejected", "only applies with nccl_ub, which is not implemented"),
    "fsdp_manual_registration": ("rejected", "only applies with nccl_ub, which is not implemented"),
    "delay_wgrad_compute": ("rejected", "delayed weight-gradient computation is not implemented"),
}
_DEFAULTS = {f.name: f.default for f in fields(DistributedDataParallelConfig)}


def check_adapter_options(config: object) -> None:
    """Apply ``DDP_CONFIG_STATUS`` to ``config`` (ours or megatron-core's, read by attribute name).

    A "rejected" field away from its default raises ``NotImplementedError`` naming it; a
    "no effect" field away from its default warns, naming it and saying why. Fields
    megatron-core adds that are not in the table are left to megatron-core.
    """
    validate_ddp_config(config)
    rejected = []
    for name, (status, why) in DDP_CONFIG_STATUS.items():
        value = getattr(config, name, _DEFAULTS[name])
        if value == _DEFAULTS[name] or name == "align_param_gather":
            continue
        if status == "rejected":  # all of them named at once (fp8_param_gather comes with its dependents)
            rejected.append(f"DistributedDataParallelConfig.{name}={value!r} is not supported: {why}")
        if status == "no effect":
            warnings.warn(f"DistributedDataParallelConfig.{name}={value!r} has no effect with megatron_fsdp: {why}",
                          UserWarning, stacklevel=3)
    if rejected:
        raise NotImplementedError("; ".join(rejected))
    if getattr(config, "use_distributed_optimizer", False) and config.data_parallel_sharding_strategy == "no_shard":
        warnings.warn(
            "DistributedDataParallelConfig.use_distributed_optimizer=True with data_parallel_sharding_strategy="
            "'no_shard': optimizer state stays replicated (the strategy decides); use 'optim' for ZeRO-1",
            UserWarning, stacklevel=3,
        )

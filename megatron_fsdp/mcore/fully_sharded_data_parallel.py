"""``FullyShardedDataParallel(config, ddp_config, module)``: megatron-core's FSDP adapter on our engine.

It translates a ``DistributedDataParallelConfig`` (ours or megatron-core's) and
the model config's ``calculate_per_token_loss`` / ``init_model_with_meta_device``
into ``fully_shard_model`` options once, and forwards the methods Megatron's
training loop calls to the resulting ``MegatronFSDP``. With megatron-core
installed it subclasses megatron-core's ``_BaseDataParallel``, so Megatron code
that type-checks its model wrapper keeps working.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.api.config import check_adapter_options
from megatron_fsdp.api.fully_shard_model import fully_shard_model
from megatron_fsdp.api.megatron_fsdp import TransparentWrapper
from megatron_fsdp.sharding.mesh import _is_flattened


def _base_class() -> type:
    try:
        from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    except Exception:  # megatron-core absent (or broken): a plain module is the base
        return nn.Module
    return _BaseDataParallel


_BASE = _base_class()


def default_unit_modules(module: nn.Module) -> list[type]:
    """The model's transformer-layer class(es): megatron-core's ``TransformerLayer`` or any class so named."""
    classes: list[type] = []
    mcore_layer: type | None = None
    with contextlib.suppress(Exception):
        from megatron.core.transformer.transformer_layer import TransformerLayer as mcore_layer  # noqa: N813
    for sub in module.modules():
        cls = type(sub)
        is_layer = cls.__name__ == "TransformerLayer" or (mcore_layer is not None and isinstance(sub, mcore_layer))
        if is_layer and cls not in classes:
            classes.append(cls)
    return classes


def _data_parallel_mesh(ddp_config: Any, device: torch.device) -> DeviceMesh:
    world = dist.get_world_size()
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    if world % instances:
        raise ValueError(
            f"DistributedDataParallelConfig.num_distributed_optimizer_instances={instances} must divide the "
            f"data-parallel size {world}"
        )
    if instances == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device.type, (instances, world // instances), mesh_dim_names=("dp_outer", "dp_shard"))


def _shard_dim(mesh: DeviceMesh) -> str:
    """FSDP's shard dimension: ``dp_shard_cp`` (dp_shard x cp: a dimension, or flattened) when the mesh has one."""
    names = mesh.mesh_dim_names or ()
    return "dp_shard_cp" if "dp_shard_cp" in names or _is_flattened(mesh, "dp_shard_cp") else "dp_shard"


def _check_mesh(mesh: DeviceMesh, ddp_config: Any) -> DeviceMesh:
    """A caller's mesh (e.g. ``(dp_shard, cp, tp)`` with model parallelism, or ``(dp_shard_cp, tp)``) must name
    its data-parallel dims."""
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_shard" not in names and "dp_shard_cp" not in names:
        raise ValueError(f"FullyShardedDataParallel(device_mesh=...) needs a 'dp_shard' (or 'dp_shard_cp': data "
                         f"parallel x context parallel) dimension; it has {names}")
    if "cp" in names and mesh.size(names.index("cp")) > 1 and not _is_flattened(mesh, "dp_shard_cp"):
        raise ValueError(
            "device_mesh has a 'cp' dimension: flatten it with dp_shard first "
            "(device_mesh[('dp_shard', 'cp')]._flatten('dp_shard_cp')), FSDP shards over both"
        )
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    outer = mesh.size(names.index("dp_outer")) if "dp_outer" in names else 1
    if outer != instances:
        raise ValueError(
            f"device_mesh has a dp_outer dimension of size {outer} but num_distributed_optimizer_instances is "
            f"{instances}; they must agree"
        )
    return mesh


class FullyShardedDataParallel(TransparentWrapper, _BASE):
    """Megatron-FSDP as a drop-in for megatron-core's data-parallel wrapper.

    Transparent to names (``TransparentWrapper``): state dicts and parameter names are
    the model's own FQNs, as with megatron-core's ``DistributedDataParallel``.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: nn.Module,
        fsdp_unit_modules: list[type] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | None = None,
        pg_collection: Any = None,
        device_mesh: DeviceMesh | None = None,
        expt_device_mesh: DeviceMesh | None = None,
    ) -> None:
        if _BASE is nn.Module:
            super().__init__()
        else:
            super().__init__(config=config, module=module)
        if pg_collection is not None:
            raise NotImplementedError(
                "FullyShardedDataParallel(pg_collection=...) is not supported: megatron_fsdp shards over the "
                "default process group (HSDP via ddp_config.num_distributed_optimizer_instances); pass None"
            )
        check_adapter_options(ddp_config)  # each field's status: megatron_fsdp.config.DDP_CONFIG_STATUS
        if not getattr(ddp_config, "use_megatron_fsdp", False) and not getattr(ddp_config, "use_custom_fsdp", False):
            raise ValueError(
                "FullyShardedDataParallel needs DistributedDataParallelConfig.use_megatron_fsdp=True "
                "(use megatron-core's DistributedDataParallel otherwise)"
            )
        self.config = config
        self.ddp_config = ddp_config
        units = fsdp_unit_modules if fsdp_unit_modules is not None else default_unit_modules(module)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(
                dist.get_backend()) and torch.cuda.is_available() else torch.device("cpu")
        mesh = _data_parallel_mesh(ddp_config, device) if device_mesh is None else _check_mesh(device_mesh, ddp_config)
        hsdp = "dp_outer" in (mesh.mesh_dim_names or ())
        self.module = fully_shard_model(
            module,
            fsdp_unit_modules=units,
            device_mesh=mesh,
            dp_shard_dim=_shard_dim(mesh),
            dp_outer_dim="dp_outer" if hsdp else None,
            tp_dim="tp" if "tp" in (mesh.mesh_dim_names or ()) else None,
            expt_device_mesh=expt_device_mesh,
            zero_dp_strategy=ddp_config.data_parallel_sharding_strategy,
            outer_dp_sharding_strategy=getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard"),
            init_model_with_meta_device=bool(getattr(config, "init_model_with_meta_device", False)),
            grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
            preserve_fp32_weights=getattr(ddp_config, "preserve_fp32_weights", True),
            overlap_grad_reduce=ddp_config.overlap_grad_reduce,
            overlap_param_gather=ddp_config.overlap_param_gather,
            calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            check_for_nan_in_grad=getattr(ddp_config, "check_for_nan_in_grad", False),
            average_in_collective=getattr(ddp_config, "average_in_collective", False),
            # The training loop marks micro-batches itself (megatron_fsdp.microbatch).
            sync_model_each_microbatch=True,
            nccl_ub=getattr(ddp_config, "nccl_ub", False),
            fsdp_double_buffer=getattr(ddp_config, "fsdp_double_buffer", False),
            disable_symmetric_registration=getattr(ddp_config, "disable_symmetric_registration", False),
            fsdp_manual_registration=getattr(ddp_config, "fsdp_manual_registration", False),
            disable_bucketing=disable_bucketing,
        )

    # -- what Megatron's training loop calls ---------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad_buffer()

    def start_grad_sync(self, *unused: Any) -> None:
        self.module.start_grad_sync()

    def finish_grad_sync(self) -> None:
        self.module.finish_grad_sync()

    def start_param_sync(self, *unused: Any, force_sync: bool = False, **kwargs: Any) -> None:
        self.module.start_param_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.module.no_sync():
            yield

    def scale_gradients(self, scaling_factor: float) -> None:
        self.module.scale_gradients(scaling_factor)

    def broadcast_params(self) -> None:
        self.module.broadcast_params()

    def stop_communication(self) -> None:
        self.module.stop_communication()

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError(
            "megatron-core's dist_checkpointing sharded_state_dict is not provided; use --ckpt-format fsdp_dtensor "
            "(megatron_fsdp.checkpoint.save_checkpoint)"
        )

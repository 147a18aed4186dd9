"""FSDPParam: one parameter of a ``ParamGroup`` and its representations.

A parameter of a group has (docs/design.md section 3):

- its rows of the group's flat main shard (``shard_view``), shown to users and the
  optimizer as a ``RaggedDTensor`` (``make_sharded``), under torch-native TP on a
  ``(tp, dp)`` mesh (``placements``, ``mesh``);
- a view of the gathered flat buffer (``unsharded_view``) that the module computes with;
- the arithmetic that brings a value from elsewhere into its layout: a full tensor, a
  TP-global tensor, a DTensor laid out by stock code (``relayout``, ``loadable``).

The group's collectives and gradient bookkeeping stay with the group
(``core/param_group.py``, ``core/group_weights.py``, ``core/group_grads.py``); this class
holds what is one parameter's alone, as PyTorch FSDP2's ``FSDPParam`` does, and is where
a tensor subclass's all-gather hooks are called (``pre_all_gather``, ``post_all_gather``;
the group's payload buffer is ``core/gather_extension.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_fsdp.sharding.layout import FlatLayout
from megatron_fsdp.sharding.mesh import DataParallelMesh
from megatron_fsdp.sharding.outer_shard import OuterShardGeometry
from megatron_fsdp.sharding.ragged_dtensor import as_ragged
from megatron_fsdp.sharding.ragged_shard import RaggedShard, full_tensor, shard_sizes, without_storage_offset
from megatron_fsdp.sharding.ragged_spec import strict_spec
from megatron_fsdp.sharding.tensor_parallel import TensorParallelSpec, sharded_mesh

# Per-object gradient bookkeeping set by the engine on its own parameters: never carried to another one.
_SKIPPED_ATTRS = {"_is_param", "main_grad", "grad_added_to_main_grad", "get_main_grad", "__fsdp_param__"}


@dataclass
class ParamRef:
    """An original parameter and every (module, attribute) that registers it."""

    param: nn.Parameter
    uses: list[tuple[nn.Module, str]] = field(default_factory=list)
    fqns: list[str] = field(default_factory=list)  # one per use, relative to the unit's module
    replicated: bool = False  # marked fsdp_no_shard (or 0-dim): never sharded
    tp: TensorParallelSpec | None = None  # torch-native TP: the flat buffer holds the TP-local tensor

    @property
    def fqn(self) -> str:
        """The name of the first use, for messages."""
        return self.fqns[0]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape the flat buffer holds: the TP-local one under tensor parallelism."""
        return self.tp.local_shape if self.tp is not None else tuple(self.param.shape)


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry attributes training loops rely on (``sequence_parallel``, ...) to ``dst``.

    A tensor subclass with all-gather hooks keeps its own state in private attributes
    (torchao's float8 weight: the wrapped tensor, its config): not copied, they would keep
    the original's storage alive and mislabel the copy.
    """
    private_state = gather_extension(src) is not None
    for name, value in vars(src).items():
        if name in _SKIPPED_ATTRS or name.startswith("_megatron_fsdp") or (private_state and name.startswith("_")):
            continue
        setattr(dst, name, value)


def gather_extension(tensor: torch.Tensor) -> type | None:
    """The class of ``tensor``'s local tensor if it defines FSDP2's all-gather hooks, else None.

    PyTorch FSDP2's tensor-subclass extension: a sharded parameter whose local tensor has
    ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` is all-gathered as what the
    pre-hook returns (torchao's float8 weights: float8 data, 1 byte per element) and
    rebuilt by the post-hook (``core/gather_extension.py``).
    """
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"{type(local).__name__} defines only one of fsdp_pre_all_gather and fsdp_post_all_gather; "
            "FSDP2's all-gather extension needs both"
        )
    if pre and type(local).__module__.split(".")[0] == "transformer_engine":
        raise NotImplementedError(_TE_QUANTIZED_PARAMS.format(cls=type(local).__name__))
    return type(local) if pre else None


# Why TransformerEngine's quantized parameters (quantized_model_init / fp8_model_init, Megatron's
# --fp8-param-gather) are refused rather than gathered through their hooks: TE 2.x's hooks read PyTorch
# FSDP2's private module state and the parameter's storage is the FP8 data itself (docs/mixed_precision.md).
_TE_QUANTIZED_PARAMS = (
    "TransformerEngine's quantized parameter class {cls} (a model built under quantized_model_init / "
    "fp8_model_init, Megatron's --fp8-param-gather) is not supported by fully_shard yet: its "
    "fsdp_pre_all_gather reads PyTorch FSDP2's private module state (_get_module_fsdp_state(module)."
    "_fsdp_param_group) and its storage is the FP8 data, not high-precision main weights. Build the model "
    "without quantized_model_init (TransformerEngine's autocast still computes in FP8) and gather float8 with "
    "MixedPrecisionPolicy(gather_format='mxfp8') or gather_dtype"
)


@dataclass(eq=False)
class ShardGeometry:
    """What every parameter of one group shares: the layout, this rank's place in it, the main shard."""

    layout: FlatLayout
    dp: DataParallelMesh
    shard_rank: int  # which of the layout's shards (pieces under outer 'optim') this rank holds
    gathers: bool  # the group is sharded over dp_shard (ZeRO-3's all-gather)
    outer: OuterShardGeometry | None  # HSDP outer 'optim'
    shard: torch.Tensor  # this rank's flat main shard


class FSDPParam:
    """Parameter ``index`` of a group: its sharded DTensor, its unsharded view, its TP placement."""

    def __init__(self, index: int, ref: ParamRef, geometry: ShardGeometry) -> None:
        self.index = index
        self.ref = ref
        self.geometry = geometry
        self.slot = geometry.layout.slots[index]
        self.piece = geometry.layout.piece(index, geometry.shard_rank)
        # Torch-native TP: the sharded parameter lives on a (tp, dp) mesh (sharding/tensor_parallel.py).
        if ref.tp is not None:
            self.mesh = sharded_mesh(ref.tp, geometry.dp)
        else:
            self.mesh = geometry.dp.mesh if geometry.outer is None else geometry.outer.flat_mesh
        # FSDP2's all-gather extension: the sharded parameter's local tensor is rebuilt as the
        # original's class around our shard view (``wrap_local``), so the class's hooks and
        # helpers (torchao's precompute_float8_dynamic_scale_for_fsdp) see what they expect.
        self.extension = gather_extension(ref.param)
        self._flatten: tuple[list[str], Any, str, dict[str, torch.Tensor]] | None = None
        self._specs: dict[torch.dtype, tuple[type[DTensor], Any]] = {}  # as_dtensor's, by local dtype
        if self.extension is not None:
            self._flatten = _flatten_template(ref.param, ref.fqn)

    @property
    def fqn(self) -> str:
        return self.ref.fqn

    # -- this rank's rows ---------------------------------------------------
    def local_rows(self, source: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``source`` (shaped like the flat buffer's copy of the parameter)."""
        return source.narrow(0, self.piece.row_start, self.piece.row_count) if source.dim() else source

    def shard_view(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows of the parameter inside a flat shard-sized tensor (the main shard by default)."""
        flat = self.geometry.shard if flat is None else flat
        numel = self.piece.row_count * self.slot.row_numel
        return flat.narrow(0, self.piece.shard_offset, numel).view(self.piece.local_shape(self.slot.shape))

    def is_shard_view(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is ``shard_view()`` (this rank's rows of the main shard), by shape and address.

        The check every forward makes per parameter (``ParamGroup._check_not_replaced``): it
        builds no view (a narrow and a view per parameter were 6% of a fake-group step).
        """
        numel = self.piece.row_count * self.slot.row_numel
        if tensor.shape != self.piece.local_shape(self.slot.shape):
            return False
        shard = self.geometry.shard
        return numel == 0 or tensor.data_ptr() == shard.data_ptr() + self.piece.shard_offset * shard.element_size()

    def slot_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The whole parameter inside a flat buffer of the group's full size (gathered, gradients)."""
        return buffer.narrow(0, self.slot.offset, self.slot.numel).view(self.slot.shape)

    def tp_local(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's piece of a full (global-shaped) value; ``full`` without TP."""
        spec = self.ref.tp
        return full if spec is None else spec.local_of(full)

    def fill_from(self, original: torch.Tensor) -> None:
        """Copy this rank's rows of the original parameter (a DTensor under TP: its local tensor) into the shard."""
        local = original.to_local() if isinstance(original, DTensor) else original
        self.shard_view().copy_(self.local_rows(local.detach()))

    def fill(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full (global) value of the parameter into the shard."""
        self.shard_view().copy_(self.local_rows(self.tp_local(full)))

    # -- the sharded DTensor ------------------------------------------------
    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape as users see it (the global one under TP)."""
        spec = self.ref.tp
        return tuple(spec.shape) if spec is not None else self.slot.shape

    def placements(self) -> list:
        """The sharded DTensor's placements on ``mesh``."""
        geometry = self.geometry
        if geometry.outer is not None:
            rows = geometry.outer.sizes_by_mesh_rank(geometry.layout.rows_per_rank(self.index))
            return [RaggedShard(0, rows, geometry.outer.order)]
        inner = RaggedShard(0, geometry.layout.rows_per_rank(self.index)) if geometry.gathers else Replicate()
        spec = self.ref.tp
        if spec is not None:  # (tp, dp) mesh: TP splits first, our rows split the TP-local tensor
            return [*spec.placements, inner]
        return [Replicate(), inner] if geometry.dp.has_outer else [inner]

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's piece of the parameter (or of its grad) as a DTensor.

        The spec depends on nothing but the local tensor's dtype (mesh, placements, global
        shape and stride are the parameter's), so after the first wrap of a dtype the
        DTensor is built on the kept spec, as FSDP2 builds its gradients: ``from_local``
        made two DTensors and a spec per call, a tenth of a fake-group step's host time.
        A local tensor that records autograd takes ``from_local`` (its backward).
        """
        local = without_storage_offset(local)
        kept = self._specs.get(local.dtype)
        if kept is None or (local.requires_grad and torch.is_grad_enabled()):
            shape = self.global_shape
            full_stride = torch.empty(shape, device="meta").stride()
            dtensor = as_ragged(strict_spec(DTensor.from_local(
                local, self.mesh, self.placements(), run_check=False, shape=torch.Size(shape), stride=full_stride,
            )))
            self._specs[local.dtype] = (type(dtensor), dtensor._spec)
            return dtensor
        cls, spec = kept
        return cls(local, spec, requires_grad=False)

    def wrap_local(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` (this rank's rows in the main shard) as the sharded DTensor's local tensor: itself, or
        for a parameter with all-gather hooks an instance of its class over ``view``."""
        if self._flatten is None:
            return view
        names, ctx, data_name, others = self._flatten
        view = without_storage_offset(view)
        inner = {**others, data_name: view}
        return self.extension.__tensor_unflatten__(inner, ctx, view.shape, view.stride())

    def make_sharded(self, original: nn.Parameter) -> nn.Parameter:
        """The sharded ``nn.Parameter`` users and the optimizer see: a DTensor over ``shard_view()``."""
        with torch.no_grad():
            dtensor = self.as_dtensor(self.wrap_local(self.shard_view()))
        param = strict_spec(nn.Parameter(dtensor, requires_grad=original.requires_grad))  # Parameter detaches
        copy_param_attributes(original, param)
        param._megatron_fsdp_sharded = True
        return param

    def unsharded_view(self, source: torch.Tensor) -> torch.Tensor:
        """What the module computes with: the parameter's slot of ``source`` (the gathered buffer, or the
        compute shard of a group that does not gather); under torch-native TP a DTensor over the TP mesh."""
        view = self.slot_view(source)
        spec = self.ref.tp
        return view if spec is None else spec.as_dtensor(view)

    # -- values from elsewhere ----------------------------------------------
    def loadable(self, value: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (full tensor, or DTensor in any layout) as this parameter's sharded DTensor.

        ``load_state_dict`` copies DTensors shard by shard; a DTensor laid out by
        stock DTensor code (``torch.chunk`` boundaries, e.g. from
        ``set_model_state_dict`` with a full state dict) would be copied into our
        ragged shards row-misaligned, so it is gathered and re-cut here.
        """
        shape = self.global_shape
        if tuple(value.shape) != shape:
            raise RuntimeError(
                f"loading '{key}': the checkpoint holds shape {tuple(value.shape)}, the parameter has {shape}"
            )
        return self.relayout(value, dtype)

    def in_our_layout(self, value: DTensor) -> bool:
        """``value``'s placements are exactly this parameter's (types and row counts)."""
        ours = self.placements()
        return list(value.placements) == ours and all(type(a) is type(b) for a, b in zip(value.placements, ours))

    def relayout(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (shaped like the parameter: full, or a DTensor in any layout) in its layout.

        Collective when ``value`` is a DTensor not in our layout; every rank takes the same
        branch (the placements are the same on all ranks).
        """
        device = self.geometry.shard.device
        if isinstance(value, DTensor):
            if self.in_our_layout(value):
                return value  # already in our layout (a sharded state dict of this model)
            if self._holds_our_rows(value):
                local = value.to_local().detach().to(device=device, dtype=dtype)
                return self.as_dtensor(local.contiguous())
            value = full_tensor(value)
        value = self.tp_local(value.detach())
        local = self.local_rows(value.to(device=device, dtype=dtype))
        return self.as_dtensor(local.contiguous())

    def _holds_our_rows(self, value: DTensor) -> bool:
        """Whether ``value``'s local pieces are exactly this rank's rows of the parameter.

        An out-of-place op on one of our shards (``sd[k].clone()``, ``.to(dtype)``, ``p * 2``,
        as FSDP2 users do to state dicts) comes back labelled plain ``Shard(0)`` with our
        ragged pieces (docs/design.md section 3); gathering it as ``torch.chunk`` pieces
        would be wrong, and refusing it broke such loads. When every rank's row count
        matches our layout, the pieces are ours and are taken as they are. One small
        all-gather per sharded mesh dim; every rank takes the same branch.
        """
        ours = self.placements()
        if value.device_mesh != self.mesh or len(value.placements) != len(ours):
            return False
        for mesh_dim, (theirs, mine) in enumerate(zip(value.placements, ours)):
            if self.ref.tp is not None and mesh_dim == 0:
                if theirs != mine or type(theirs) is not type(mine):  # the TP dimension: the same placement
                    return False
            elif isinstance(mine, RaggedShard):
                if type(theirs) is not Shard or theirs.dim != 0 or mine.order != tuple(range(len(mine.order))):
                    return False
                if shard_sizes(value, mesh_dim) != list(mine.local_sizes):
                    return False
            elif not isinstance(theirs, Replicate):
                return False
        return True

    # -- FSDP2's all-gather extension ---------------------------------------
    def pre_all_gather(
        self, local: torch.Tensor, mesh: Any, module: nn.Module, policy: Any
    ) -> tuple[torch.Tensor, Any]:
        """Run ``local``'s ``fsdp_pre_all_gather``: what this rank sends for the parameter, and its metadata.

        ``local``: the sharded DTensor's local tensor, read at each gather (torchao keeps its
        precomputed scale there). Both of FSDP2's signatures are accepted, as torch 2.13 does:
        ``(mesh)`` and ``(mesh, outer_size, outer_stride, module, mp_policy)``; ``mp_policy``
        is ours, whose ``param_dtype`` means what FSDP2's does. The hook must return one
        tensor holding this rank's rows (the flat buffer carries one per parameter).
        """
        hook = local.fsdp_pre_all_gather
        count = len(inspect.signature(hook).parameters)
        if count == 1:
            inputs, metadata = hook(mesh)
        elif count == 5:
            shape = torch.Size(self.global_shape)
            inputs, metadata = hook(mesh, shape, torch.empty(shape, device="meta").stride(), module, policy)
        else:
            raise TypeError(
                f"{type(local).__name__}.fsdp_pre_all_gather{inspect.signature(hook)} of parameter '{self.fqn}': "
                "FSDP2's signature is (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
            )
        expected = self.piece.local_shape(self.slot.shape)
        if len(inputs) != 1 or tuple(inputs[0].shape) != tuple(expected):
            raise NotImplementedError(
                f"{type(local).__name__}.fsdp_pre_all_gather of parameter '{self.fqn}' returned "
                f"{[tuple(t.shape) for t in inputs]}; fully_shard gathers one tensor per parameter shaped like "
                f"this rank's rows {tuple(expected)} (FSDP2's extension allows more; not supported here)"
            )
        return inputs[0], metadata

    def post_all_gather(
        self, local: torch.Tensor, gathered: torch.Tensor, metadata: Any, dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run ``local``'s ``fsdp_post_all_gather`` on the gathered payload ``gathered`` (the whole parameter).

        Without ``out`` returns the compute-time tensor (torchao: a ``Float8TrainingTensor`` over
        ``gathered``); with ``out`` (that tensor from an earlier gather, over the same memory)
        refreshes it in place, as FSDP2 does after its first all-gather.
        """
        if out is not None:
            local.fsdp_post_all_gather((gathered,), metadata, dtype, out=out)
            return None
        tensor, _inner = local.fsdp_post_all_gather((gathered,), metadata, dtype)
        return tensor


def _flatten_template(param: torch.Tensor, fqn: str) -> tuple[list[str], Any, str, dict[str, torch.Tensor]]:
    """How to rebuild ``param``'s class around another tensor: ``__tensor_flatten__``'s names and context,
    the one inner tensor holding the values (shaped and typed like ``param``), the others as they are."""
    if not hasattr(type(param), "__tensor_flatten__"):
        raise NotImplementedError(
            f"parameter '{fqn}' ({type(param).__name__}) defines FSDP2's all-gather hooks but not "
            "__tensor_flatten__/__tensor_unflatten__, which fully_shard uses to rebuild it around its shard"
        )
    names, ctx = param.__tensor_flatten__()
    inner = {name: getattr(param, name) for name in names}
    data = [n for n, t in inner.items() if t.shape == param.shape and t.dtype == param.dtype]
    if len(data) != 1:
        raise NotImplementedError(
            f"parameter '{fqn}' ({type(param).__name__}): fully_shard rebuilds a subclass with all-gather hooks "
            f"around its shard through the one inner tensor shaped like it; found {data or 'none'} among {names}"
        )
    others = {n: t for n, t in inner.items() if n != data[0]}
    return list(names), ctx, data[0], others


"""MixedPrecisionPolicy: which dtype each role uses, and the module-boundary casts.

Roles (Megatron-FSDP's names in brackets, FSDP2's in parentheses):

- ``param_dtype``: the compute (model) weights the module runs with and the
  all-gather moves; ``None`` keeps each parameter's own dtype. (FSDP2: the same.)
- ``main_params_dtype``: the sharded main weights the optimizer steps
  [``preserve_fp32_weights=True`` is fp32, the default]; ``None`` keeps the
  parameter's dtype. (FSDP2 always keeps the parameter's dtype: ``None``.)
- ``main_grads_dtype``: the dtype gradients accumulate in across micro-batches;
  ``None`` follows ``main_params_dtype``.
- ``grad_comm_dtype``: the dtype of the gradient reduction
  [``grad_reduce_in_fp32=True`` is fp32]; ``None`` follows ``main_grads_dtype``.
  (FSDP2: ``reduce_dtype``, whose ``None`` means ``param_dtype``.)
- ``output_dtype``: cast the floating-point forward outputs of every unit to it;
  ``None`` leaves them. (FSDP2: the same.)
- ``cast_forward_inputs``: cast floating-point forward inputs of every unit to
  ``param_dtype``. (FSDP2: the same.)
- ``gather_dtype``: a float8 dtype (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``)
  the ZeRO-3 weight all-gather moves, 1 byte per element: each parameter's rows are
  scaled by one factor agreed across the shard group (``max / amax`` of the whole
  parameter), cast, gathered and dequantized to ``param_dtype`` (``core/quantized_gather.py``);
  the main weights stay as they are. ``None``: the gather moves ``param_dtype``. (FSDP2: none;
  torchao's float8 weights do it through tensor-subclass hooks, which work here too.)
- ``gather_format``: ``"mxfp8"`` makes that gather block-scaled instead: e4m3 elements with one
  power-of-two ``float8_e8m0fnu`` scale per 32 consecutive elements along the last dim (the OCP MX
  layout), quantized locally and the scales gathered beside the payload; parameters that do not cut
  into whole 32-element blocks on every rank take the per-tensor e4m3 path. ``gather_dtype`` may be
  left ``None`` or ``torch.float8_e4m3fn`` with it. ``None``: per-tensor (``gather_dtype``) or none.

``resolve_mp_policy`` accepts ours or PyTorch's
``torch.distributed.fsdp.MixedPrecisionPolicy`` and returns ours (``from_fsdp2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from megatron_fsdp.core.fsdp2_classes import is_fsdp2_instance

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
GATHER_FORMATS = ("mxfp8",)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    output_dtype: torch.dtype | None = None
    gather_dtype: torch.dtype | None = None
    gather_format: str | None = None

    def __post_init__(self) -> None:
        if self.gather_format is not None and self.gather_format not in GATHER_FORMATS:
            raise ValueError(
                f"MixedPrecisionPolicy.gather_format={self.gather_format!r} is not a gather format "
                f"(valid: None, {', '.join(repr(f) for f in GATHER_FORMATS)})"
            )
        if self.gather_format == "mxfp8" and self.gather_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(
                f"MixedPrecisionPolicy.gather_format='mxfp8' has float8_e4m3fn elements; gather_dtype="
                f"{self.gather_dtype} contradicts it (leave it None or torch.float8_e4m3fn)"
            )
        if self.gather_dtype is not None and self.gather_dtype not in _FLOAT8:
            valid = ", ".join(str(d) for d in _FLOAT8)
            raise ValueError(f"MixedPrecisionPolicy.gather_dtype={self.gather_dtype!r} is not a float8 dtype ({valid})")
        for name in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                valid = ", ".join(str(d) for d in _FLOATS)
                raise ValueError(f"MixedPrecisionPolicy.{name}={value!r} is not a floating-point dtype ({valid})")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )
        main, compute = self.main_params_dtype, self.param_dtype
        if main is not None and compute is not None and torch.finfo(main).bits < torch.finfo(compute).bits:
            raise ValueError(
                f"MixedPrecisionPolicy: main_params_dtype={main} is less precise than param_dtype={compute}; "
                "the optimizer's main weights must hold at least the compute weights' precision"
            )

    @property
    def quantized_gather_dtype(self) -> torch.dtype | None:
        """The float8 dtype the weight all-gather moves (``gather_dtype``, e4m3 under ``"mxfp8"``), or None."""
        if self.gather_format == "mxfp8":
            return torch.float8_e4m3fn
        return self.gather_dtype

    @classmethod
    def from_fsdp2(cls, policy: Any) -> MixedPrecisionPolicy:
        """Ours for PyTorch's FSDP2 ``MixedPrecisionPolicy``, with FSDP2's meaning.

        Main weights and gradients keep each parameter's dtype (FSDP2 steps the
        sharded parameters in their own dtype); ``reduce_dtype`` is our
        ``grad_comm_dtype``, and its ``None`` means ``param_dtype`` as in FSDP2.
        """
        reduce_dtype = policy.reduce_dtype if policy.reduce_dtype is not None else policy.param_dtype
        return cls(
            param_dtype=policy.param_dtype,
            main_params_dtype=None,
            main_grads_dtype=None,
            grad_comm_dtype=reduce_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
            output_dtype=getattr(policy, "output_dtype", None),
        )

    def dtypes_for(self, original: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
        """(compute, main, main grad, grad comm) dtypes for a parameter of dtype ``original``."""
        if not original.is_floating_point:
            return original, original, original, original
        compute = self.param_dtype or original
        main = self.main_params_dtype or original
        grads = self.main_grads_dtype or main
        return compute, main, grads, self.grad_comm_dtype or grads

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with floating-point tensors in ``param_dtype`` (if ``cast_forward_inputs``)."""
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        return cast_floating((args, kwargs), self.param_dtype)

    def cast_outputs(self, output: Any) -> Any:
        """``output`` with floating-point tensors in ``output_dtype`` (unchanged if it is None)."""
        if self.output_dtype is None:
            return output
        return cast_floating(output, self.output_dtype)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``tree`` (lists, tuples, dicts, namedtuples) cast to ``dtype``."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def resolve_mp_policy(policy: Any, *, where: str = "fully_shard") -> MixedPrecisionPolicy | None:
    """Ours, for ``None``, ours, or PyTorch's FSDP2 ``MixedPrecisionPolicy``; TypeError otherwise."""
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if is_fsdp2_instance(policy, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy.from_fsdp2(policy)
    raise TypeError(
        f"{where}: mp_policy must be a megatron_fsdp.MixedPrecisionPolicy or a "
        f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}"
    )

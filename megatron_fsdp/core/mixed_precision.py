"""MixedPrecisionPolicy: which dtype each role uses. Validation only; the engine reads it.

Roles (Megatron-FSDP's names in brackets):

- ``param_dtype``: the compute (model) weights the module runs with and the
  all-gather moves; ``None`` keeps each parameter's own dtype.
- ``main_params_dtype``: the sharded main weights the optimizer steps
  [``preserve_fp32_weights=True`` is fp32, the default]; ``None`` keeps the
  parameter's dtype.
- ``main_grads_dtype``: the dtype gradients accumulate in across micro-batches;
  ``None`` follows ``main_params_dtype``.
- ``grad_comm_dtype``: the dtype of the gradient reduction
  [``grad_reduce_in_fp32=True`` is fp32]; ``None`` follows ``main_grads_dtype``.
- ``cast_forward_inputs``: cast floating-point forward inputs of every unit to
  ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                valid = ", ".join(str(d) for d in _FLOATS)
                raise ValueError(f"MixedPrecisionPolicy.{name}={value!r} is not a floating-point dtype ({valid})")
        main, compute = self.main_params_dtype, self.param_dtype
        if main is not None and compute is not None and torch.finfo(main).bits < torch.finfo(compute).bits:
            raise ValueError(
                f"MixedPrecisionPolicy: main_params_dtype={main} is less precise than param_dtype={compute}; "
                "the optimizer's main weights must hold at least the compute weights' precision"
            )

    def dtypes_for(self, original: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
        """(compute, main, main grad, grad comm) dtypes for a parameter of dtype ``original``."""
        if not original.is_floating_point:
            return original, original, original, original
        compute = self.param_dtype or original
        main = self.main_params_dtype or original
        grads = self.main_grads_dtype or main
        return compute, main, grads, self.grad_comm_dtype or grads

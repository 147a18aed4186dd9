"""Megatron-LM v2's ``MixedPrecisionPolicy``, with its defaults, mapped onto the engine's policy.

Its three fields are the engine policy's fields of the same names (``megatron_fsdp.MixedPrecisionPolicy``)
with one difference of default: here ``main_grads_dtype=None`` means each parameter's own dtype (the
compute dtype), where the engine's ``None`` follows ``main_params_dtype``. So a bf16 model under the
default policy keeps fp32 main weights for the optimizer and reduces and accumulates bf16 gradients,
as Megatron-LM's ``megatron_fsdp.experimental`` does; ``fully_shard_optimizer`` casts them to the
main weights' dtype around each step.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy as EnginePolicy

__all__ = ["SUPPORTED_DTYPES", "MixedPrecisionPolicy"]

# Parameter dtypes the placements API shards (Megatron-LM v2's rule); others raise NotImplementedError.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the main weights, the main gradients and the gradient reduction.

    Attributes:
        main_params_dtype: the optimizer's (sharded) main weights; ``None`` keeps the parameter dtype.
        main_grads_dtype: the reduced, accumulated gradients; ``None`` keeps the parameter dtype.
        grad_comm_dtype: the dtype the gradient reduction moves; ``None`` follows ``main_grads_dtype``.
    """

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        """Refuse a field that is not a floating-point dtype of ``SUPPORTED_DTYPES``."""
        for name in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in SUPPORTED_DTYPES:
                raise NotImplementedError(f"Unsupported dtype: {value} (MixedPrecisionPolicy.{name}).")

    def engine_policy(self, param_dtype: torch.dtype) -> EnginePolicy:
        """The engine policy for parameters of ``param_dtype`` (``main_grads_dtype=None`` made explicit)."""
        return EnginePolicy(
            main_params_dtype=self.main_params_dtype,
            main_grads_dtype=self.main_grads_dtype or param_dtype,
            grad_comm_dtype=self.grad_comm_dtype,
        )

"""How reduced gradients are normalised: mean (default), sum, or a caller's factor.

Scaling is applied to the local gradients before a SUM collective. That gives
the same numbers on gloo and NCCL (``ReduceOp.AVG`` and NCCL's pre-multiply
sum are not available everywhere) and, for the mean, exactly what
``DistributedDataParallel`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradScaling:
    """``mode``: ``"mean"`` over the data-parallel ranks, ``"sum"``, or ``"factor"`` (multiply by ``factor``)."""

    mode: str = "mean"
    factor: float = 1.0

    def apply(self, grads: torch.Tensor, dp_size: int) -> None:
        """Scale ``grads`` in place before they are summed over ``dp_size`` ranks."""
        if self.mode == "mean":
            if dp_size > 1:
                grads.div_(dp_size)
        elif self.mode == "factor":
            grads.mul_(self.factor)


def resolve_grad_scaling(value: str | float | GradScaling, *, argument: str = "gradient_scaling") -> GradScaling:
    """Accept ``"mean"``, ``"sum"``, a number (the factor) or a ``GradScaling``."""
    if isinstance(value, GradScaling):
        return value
    if value in ("mean", "sum"):
        return GradScaling(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return GradScaling("factor", float(value))
    raise ValueError(
        f"{argument}={value!r} is not valid: use 'mean' (average over data-parallel ranks), "
        "'sum' (e.g. per-token loss normalised by the training loop), or a positive number to multiply by"
    )

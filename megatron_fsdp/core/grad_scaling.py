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

    def write(self, out: torch.Tensor, grads: torch.Tensor, dp_size: int) -> None:
        """``out`` = ``grads`` scaled as ``apply`` would scale them: one pass where the dtypes match.

        The same operation on the same values as ``out.copy_(grads)`` then ``apply(out)``, so
        the same numbers; a cast (bf16 gradients into an fp32 buffer) is copied first and
        scaled in ``out``'s dtype, as ``apply`` would.
        """
        if grads.dtype != out.dtype:
            out.copy_(grads)
            self.apply(out, dp_size)
        elif self.mode == "mean" and dp_size > 1:
            torch.div(grads, dp_size, out=out)
        elif self.mode == "factor":
            torch.mul(grads, self.factor, out=out)
        else:
            out.copy_(grads)


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

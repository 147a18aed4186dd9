"""The front-end's own reductions (loss totals, flags) on tensors lent to the backend.

Through ``megatron_fsdp/comm/lending.py``: a tensor handed to gloo and dropped when the call
returns can be released by gloo's worker thread during the interpreter's exit, which aborts the
process (docs/api.md, "Shutting down"). One module for it, so that the training loop itself
imports nothing of the library (its backends do).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp.comm.lending import on_aliases


def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> None:
    """``torch.distributed.all_reduce(tensor, **kwargs)`` (synchronous, in place), the tensor lent."""
    on_aliases(dist.all_reduce, tensor, **kwargs)

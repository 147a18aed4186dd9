"""Named ranges around the engine's communication points, for traces.

``trace_range(name, device)`` marks a region as ``torch.profiler.record_function``
(visible in ``torch.profiler`` / Kineto traces) when a profiler is running, and as an
NVTX range (visible in Nsight Systems) when the work is on CUDA. With no profiler and
no CUDA it returns a shared no-op context: one C call and no allocation, so the ranges
can stay in the hooks permanently.

Range names (all prefixed ``megatron_fsdp.``):

- ``unshard.issue``: start the all-gathers of a unit (or a prefetch);
- ``unshard.wait``: wait for them and install the gathered parameters;
- ``reshard``: free the gathered weights;
- ``reduce.issue``: start a gradient reduce-scatter / all-reduce;
- ``reduce.wait``: wait for a reduction and install the sharded gradients.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

PREFIX = "megatron_fsdp."
UNSHARD_ISSUE = PREFIX + "unshard.issue"
UNSHARD_WAIT = PREFIX + "unshard.wait"
RESHARD = PREFIX + "reshard"
REDUCE_ISSUE = PREFIX + "reduce.issue"
REDUCE_WAIT = PREFIX + "reduce.wait"
RANGE_NAMES = (UNSHARD_ISSUE, UNSHARD_WAIT, RESHARD, REDUCE_ISSUE, REDUCE_WAIT)

_NOOP = contextlib.nullcontext()
_profiler_enabled = getattr(torch.autograd, "_profiler_enabled", lambda: False)


class _NvtxRange:
    """An NVTX push/pop pair, plus a profiler range when a profiler runs."""

    __slots__ = ("_name", "_record")

    def __init__(self, name: str) -> None:
        self._name = name
        self._record = torch.profiler.record_function(name) if _profiler_enabled() else None

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self._name)
        if self._record is not None:
            self._record.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._record is not None:
            self._record.__exit__(*exc)
        torch.cuda.nvtx.range_pop()


def trace_range(name: str, device: torch.device | None = None) -> AbstractContextManager:
    """A context marking ``name`` for the profiler (and NVTX when ``device`` is CUDA)."""
    if device is not None and device.type == "cuda":
        return _NvtxRange(name)
    if _profiler_enabled():
        return torch.profiler.record_function(name)
    return _NOOP

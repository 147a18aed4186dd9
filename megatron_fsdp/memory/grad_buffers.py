"""Spare gradient buffers: reused by the next unit's reduction within one backward pass.

Each unit's gradients are gathered into a full-size flat buffer when they are reduced,
and it dies once its reduce-scatter has landed. A fresh buffer per unit costs, on CPU, page faults on
first touch (4.3 ms to allocate and zero a 7 MiB block buffer against 0.5 ms to
re-zero one already touched); on CUDA it churns the caching allocator. So a
finished reduction hands its buffer here and the next unit of the same size takes
it. At most ``MAX_SPARE`` are kept and all are dropped at the end of every backward,
so nothing is held between steps and the peak is unchanged: a buffer is handed back
just as the reduction that used it finishes, and taken by the next unit's reduction.

One ``GradSpares`` per root (every unit under it shares the root's): two models in
one process never trade buffers, and each root's counters are its own.

Stream safety (CUDA): a buffer is handed back only after ``Pending.wait()`` made the
current stream wait for the collective that read it; filling it again is queued on
that stream after it. A reduction whose wait raised never hands its buffer back: the
collective may still be reading it (see ``collectives.Pending``).
"""

from __future__ import annotations

import torch

MAX_SPARE = 2


class GradSpares:
    """Up to ``MAX_SPARE`` gradient buffers between a reduction's end and the next unit's backward."""

    def __init__(self) -> None:
        self._spare: list[torch.Tensor] = []
        self.allocated = 0  # buffers made since this root was sharded (for tests and benchmarks)
        self.reused = 0

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D gradient buffer with undefined contents, re-using a spare one of the same size, dtype and device."""
        for i, buffer in enumerate(self._spare):
            if buffer.numel() == numel and buffer.dtype == dtype and buffer.device == device:
                self.reused += 1
                return self._spare.pop(i)
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed 1-D gradient buffer (see ``empty``)."""
        return self.empty(numel, dtype, device).zero_()

    def spare_count(self) -> int:
        """How many spare buffers are held now (0 outside a backward)."""
        return len(self._spare)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (no tensor may alias it any more) for the next ``zeros`` of its size."""
        if len(self._spare) < MAX_SPARE:
            self._spare.append(buffer)

    def drop_all(self) -> None:
        """Release every spare buffer (end of backward)."""
        self._spare.clear()

"""FlatBuffer: one flat tensor whose storage can be released and re-acquired.

Views taken of the buffer stay valid objects across ``free()``/``allocate()``
(only their storage's memory comes and goes), so unsharded parameters are created
once and re-pointed at fresh data by an all-gather, with no copy and no
re-registration. The memory is borrowed from a ``BufferPool`` (memory/allocator.py), so
units and steps reuse it instead of allocating afresh. It knows nothing of
sharding, optimizers or precision.
"""

from __future__ import annotations

import weakref

import torch

from megatron_fsdp.memory.allocator import BufferPool, default_pool


class FlatBuffer:
    """A 1-D tensor of fixed numel whose storage is allocated on demand."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        allocated: bool = False,
        pool: BufferPool | None = None,
    ) -> None:
        self.numel = numel
        self.pool = default_pool() if pool is None else pool
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = self.data.untyped_storage().nbytes()
        self._pooled = False  # the current memory is on loan from the pool
        self._on_loan: weakref.finalize | None = None  # tells the pool if this buffer dies holding its memory
        self.abandoned = False  # see ``abandon``
        if not allocated:
            self.free()

    @property
    def allocated(self) -> bool:
        # A pooled slab may be larger than the buffer.
        return self.data.untyped_storage().nbytes() >= self._nbytes

    def allocate(self) -> torch.Tensor:
        """Give the buffer storage (contents undefined) and return it."""
        if self.abandoned:
            raise RuntimeError("this buffer was abandoned after a failed collective and cannot be used again")
        if not self.allocated:
            self._pooled = self.pool.acquire(self.data.untyped_storage(), self._nbytes)
            if self._pooled:
                # Dropped while on loan (a model deleted with its weights gathered): the
                # memory dies with the storage, and the pool stops counting it as lent.
                self._on_loan = weakref.finalize(self, self.pool.forget, self.data.untyped_storage().nbytes())
                self._on_loan.atexit = False
        return self.data

    def free(self) -> None:
        """Release the storage; views keep their shapes but hold no data (a no-op once abandoned)."""
        if self._nbytes and self.allocated and not self.abandoned:
            if self._pooled:
                self._on_loan.detach()
                self.pool.release(self.data.untyped_storage())
                self._pooled = False
            else:
                self.data.untyped_storage().resize_(0)

    def abandon(self) -> None:
        """Keep the current memory for good: never free it, give it back to the pool or reuse it.

        For a buffer a failed collective may still be writing into: freeing it then
        (``resize_(0)``) corrupts the heap, and lending it again corrupts another buffer.
        The memory is leaked instead, which only happens on a path that already raised.
        """
        self.abandoned = True

    def view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``numel(shape)`` elements starting at ``offset``."""
        numel = 1
        for d in shape:
            numel *= d
        return self.data.narrow(0, offset, numel).view(shape)

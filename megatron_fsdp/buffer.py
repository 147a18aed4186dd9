"""FlatBuffer: one flat tensor whose storage can be released and re-acquired.

Views taken of the buffer stay valid objects across ``free()``/``allocate()``
(only their storage is resized), so unsharded parameters are created once and
re-pointed at fresh data by an all-gather, with no copy and no re-registration.
It knows nothing of sharding, optimizers or precision.
"""

from __future__ import annotations

import torch


class FlatBuffer:
    """A 1-D tensor of fixed numel whose storage is allocated on demand."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, allocated: bool = False) -> None:
        self.numel = numel
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = self.data.untyped_storage().nbytes()
        if not allocated:
            self.free()

    @property
    def allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() == self._nbytes

    def allocate(self) -> torch.Tensor:
        """Give the buffer storage (contents undefined) and return it."""
        if not self.allocated:
            self.data.untyped_storage().resize_(self._nbytes)
        return self.data

    def free(self) -> None:
        """Release the storage; views keep their shapes but hold no data."""
        if self._nbytes and self.allocated:
            self.data.untyped_storage().resize_(0)

    def view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``numel(shape)`` elements starting at ``offset``."""
        numel = 1
        for d in shape:
            numel *= d
        return self.data.narrow(0, offset, numel).view(shape)

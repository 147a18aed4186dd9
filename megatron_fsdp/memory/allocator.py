"""BufferPool: reusable memory for transient unsharded weights.

Every unit gathers its weights into a full-size buffer before use and frees it after.
Allocating that afresh each time costs a system call and page faults per buffer on CPU
(the kernel zeroes every new page) and fragments the CUDA caching allocator. The pool
keeps the freed memory as *slabs* and lends them again, across units and across steps;
in steady state a step allocates nothing. ``FlatBuffer`` (the gathered weights) uses
it; ``tensor``/``release_tensor`` lend plain tensors (gradient buffers are not pooled
yet: see docs/performance.md).

How memory is lent without breaking autograd: the unsharded parameters are views of
one storage object that autograd holds on to between forward and backward, so the
storage object must stay the same while its memory comes and goes. ``acquire`` moves
a slab's memory *into* the caller's (empty) storage object and ``release`` moves it
back out, with ``UntypedStorage._swap_data_ptr_`` (no copy). Where that private
method is missing the pool falls back to plain ``resize_`` (no pooling, same results).

Sizing: a request takes the smallest free slab that holds it and wastes at most
``max_waste`` times its size; otherwise a new slab of exactly its size is made. The
pool therefore grows to the largest set of buffers alive at once (for a transformer:
the root's weights, the unit computing and the prefetched one) and then stops
growing; ``reserved_bytes`` is that size.

Stream safety (CUDA): ``release`` records an event on the current stream; the next
``acquire`` of that slab makes the current stream wait for it. The engine releases a
buffer only after the current stream has waited for every collective that used it
(never release a buffer a collective in flight still reads or writes; docs/design.md section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


@dataclass
class _Slab:
    storage: torch.UntypedStorage  # owns the memory while the slab is free
    nbytes: int
    ready: object | None = None  # CUDA event: the last user's work on the slab is queued before it
    stream: object | None = None  # CUDA stream it was released on (``ready`` was recorded there)


def _free_after_stream(slab: _Slab) -> None:
    """Let the caching allocator reuse a CUDA slab only once the work queued on its release stream is done.

    Work queued before the release may still use the memory, and the caching allocator does not
    know of it when the releasing stream is not the one the memory was allocated on. Rather than
    stalling the host on ``slab.ready`` (``Event.synchronize``), mark the memory as used on that
    stream (``record_stream``, as PyTorch's own cross-stream frees do): the allocator records an
    event there when the last reference goes and defers reuse until it has passed.
    """
    view = torch.empty(0, dtype=torch.uint8, device=slab.storage.device)
    view.set_(slab.storage, 0, (slab.nbytes,), (1,))
    view.record_stream(slab.stream)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters (see ``BufferPool``)."""

    reserved_bytes: int  # memory held by the pool: free slabs plus lent ones
    lent_bytes: int  # memory lent out now
    peak_lent_bytes: int  # most memory lent at once
    slabs: int  # slabs ever created and not trimmed
    allocations: int  # requests that created a new slab
    reuses: int  # requests served from a free slab


class BufferPool:
    """Slabs of device memory lent to empty storages and taken back (see module docstring)."""

    def __init__(self, max_waste: float = 2.0, keep_between_steps: bool = True, enabled: bool = True) -> None:
        if max_waste < 1.0:
            raise ValueError(f"max_waste must be >= 1.0 (a slab at least as large as the request), got {max_waste}")
        self.max_waste = max_waste
        self.wanted = enabled  # False: plain allocations (resize_), no pooling
        # False: give the free slabs back at the end of every backward, so the optimizer
        # step's temporaries can use that memory (lower peak), at the cost of allocating
        # the slabs again each step (on CPU: page faults; on CUDA: the caching allocator's cost).
        self.keep_between_steps = keep_between_steps
        self._free: dict[torch.device, list[_Slab]] = {}
        self.reserved_bytes = 0
        self.lent_bytes = 0
        self.peak_lent_bytes = 0
        self.slabs = 0
        self.allocations = 0
        self.reuses = 0

    @property
    def enabled(self) -> bool:
        """Whether memory is pooled: wanted, and this torch can move memory between storages."""
        return self.wanted and _swap is not None

    def acquire(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` at least ``nbytes`` of memory; True if it came from the pool.

        The contents are undefined. Memory acquired from the pool must be given back
        with ``release``; with False the storage was simply resized (free it with ``resize_(0)``).
        """
        if storage.nbytes() != 0:
            raise RuntimeError(f"acquire: the storage must be empty, it holds {storage.nbytes()} bytes")
        if nbytes <= 0 or not self.enabled:
            storage.resize_(nbytes)
            return False
        slab = self._take(storage.device, nbytes)
        if slab.ready is not None:
            torch.cuda.current_stream(storage.device).wait_event(slab.ready)
        _swap(storage, slab.storage)
        self.lent_bytes += slab.nbytes
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
        return True

    def release(self, storage: torch.UntypedStorage) -> None:
        """Take back the memory ``acquire`` lent to ``storage``, leaving it empty."""
        holder = torch.UntypedStorage(0, device=storage.device)
        _swap(holder, storage)
        slab = _Slab(holder, holder.nbytes())
        if holder.device.type == "cuda":
            # Work queued so far on this stream may still use the memory.
            slab.stream = torch.cuda.current_stream(holder.device)
            slab.ready = torch.cuda.Event()
            slab.ready.record(slab.stream)
        self.lent_bytes -= slab.nbytes
        self._free.setdefault(holder.device, []).append(slab)

    def forget(self, nbytes: int) -> None:
        """A slab of ``nbytes`` lent out died with its borrower instead of coming back: stop counting it."""
        self.lent_bytes -= nbytes
        self.reserved_bytes -= nbytes
        self.slabs -= 1

    def tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of pooled memory (contents undefined); give it back with ``release_tensor``."""
        out = torch.empty(0, dtype=dtype, device=device)
        storage = out.untyped_storage()
        nbytes = numel * out.element_size()
        if not self.acquire(storage, nbytes):
            return torch.empty(numel, dtype=dtype, device=device)
        out.set_(storage, 0, (numel,), (1,))
        out._megatron_fsdp_pool = self
        return out

    def release_tensor(self, tensor: torch.Tensor) -> None:
        """Give back the memory of a tensor made by ``tensor`` (every view of it becomes empty).

        A no-op for any other tensor, and for the same tensor a second time.
        """
        if getattr(tensor, "_megatron_fsdp_pool", None) is self:
            del tensor._megatron_fsdp_pool
            self.release(tensor.untyped_storage())

    def trim(self) -> int:
        """Free every slab not lent out; return the bytes freed."""
        for slabs in self._free.values():
            for slab in slabs:
                if slab.stream is not None:
                    _free_after_stream(slab)
        freed = sum(s.nbytes for slabs in self._free.values() for s in slabs)
        self.slabs -= sum(len(slabs) for slabs in self._free.values())
        self._free.clear()
        self.reserved_bytes -= freed
        return freed

    def end_of_forward(self) -> None:
        """Called when a root's forward that a backward will follow is over: give back the free slabs.

        A training step's memory peaks right after the forward, while every activation is
        alive and the loss's gradient (and the root's weight gradients) are made; the slabs
        the forward's units gave back sit idle then, so holding them would put the pool's
        size on top of that peak. The backward's gathers allocate them again (on CPU: page
        faults of one or two units' weights per step); the forward reuses what the
        backward gave back.
        """
        self.trim()

    def end_of_backward(self) -> None:
        """Called once a backward that an optimizer step may follow is over (see ``keep_between_steps``)."""
        if not self.keep_between_steps:
            self.trim()

    def stats(self) -> PoolStats:
        """Current counters."""
        return PoolStats(self.reserved_bytes, self.lent_bytes, self.peak_lent_bytes, self.slabs,
                         self.allocations, self.reuses)

    def _take(self, device: torch.device, nbytes: int) -> _Slab:
        free = self._free.get(device, [])
        fits = [s for s in free if nbytes <= s.nbytes <= self.max_waste * nbytes]
        if fits:
            best = min(fits, key=lambda s: s.nbytes)
            free.remove(best)
            self.reuses += 1
            return best
        self.allocations += 1
        self.slabs += 1
        self.reserved_bytes += nbytes
        return _Slab(torch.UntypedStorage(nbytes, device=device), nbytes)


# On by default: 100 runs of the engine, accumulation and perf suites under glibc's heap
# checking (python -m tests.soak: libc_malloc_debug.so.0, MALLOC_CHECK_=3), 50 with the
# pool on and 50 off, gave 0 crashes and 0 failures (docs/performance.md); on 2 gloo
# ranks the pool takes the benchmark from 0.79x to 0.72-0.74x FSDP2's step time for
# 12.6 MiB more peak (measured with the mmap threshold forced down, 2026-11-22; since
# end_of_forward frees idle slabs, the peak is the pool-off one). Whether a root uses it
# is its ``EngineOptions.buffer_pool`` (core/options.py); a root with the pool off gets ``unpooled()``.
_default_pool = BufferPool()
_unpooled = BufferPool(enabled=False)


def pool_for(enabled: bool) -> BufferPool:
    """The process-wide pool, or (``enabled=False``) a pool that never pools (plain ``resize_``)."""
    return _default_pool if enabled else _unpooled


def default_pool() -> BufferPool:
    """The process-wide pool every ``FlatBuffer`` and gradient buffer uses unless told otherwise."""
    return _default_pool


def pool_stats() -> PoolStats:
    """Counters of the process-wide pool; ``reserved_bytes`` is the pool size."""
    return _default_pool.stats()

"""BufferPool and FlatBuffer in one process: lending, reuse, sizing, views surviving."""

import pytest
import torch

from megatron_fsdp.memory.allocator import BufferPool
from megatron_fsdp.memory.buffer import FlatBuffer

pytestmark = pytest.mark.skipif(not BufferPool().enabled, reason="this torch cannot move storage memory")


def test_flat_buffer_views_follow_pooled_memory():
    pool = BufferPool()
    buf = FlatBuffer(10, torch.float32, torch.device("cpu"), allocated=True, pool=pool)
    view = buf.view(2, (2, 3))
    buf.free()
    assert not buf.allocated and pool.stats().reserved_bytes == 0  # construction memory is not pooled
    data = buf.allocate()
    data.copy_(torch.arange(10.0))
    assert view.data_ptr() == data.data_ptr() + 2 * 4
    assert torch.equal(view, torch.arange(2.0, 8.0).view(2, 3))
    buf.free()
    assert pool.stats().lent_bytes == 0 and pool.stats().reserved_bytes == 40


def test_memory_is_reused_across_buffers_and_rounds():
    pool = BufferPool()
    units = [FlatBuffer(1000, torch.float32, torch.device("cpu"), pool=pool) for _ in range(6)]
    for _ in range(3):  # three "steps", prefetch depth 1: at most two units allocated at once
        for i, unit in enumerate(units):
            unit.allocate().fill_(i)
            if i:
                units[i - 1].free()
        units[-1].free()
    stats = pool.stats()
    assert stats.allocations == 2, stats  # double buffering, nothing more
    assert stats.reuses == 3 * 6 - 2
    assert stats.reserved_bytes == 2 * 4000 and stats.peak_lent_bytes == 2 * 4000 and stats.lent_bytes == 0


def test_fit_rule_limits_waste():
    pool = BufferPool(max_waste=2.0)
    big = pool.tensor(1000, torch.float32, torch.device("cpu"))
    pool.release_tensor(big)
    small = pool.tensor(100, torch.float32, torch.device("cpu"))  # 10x smaller: a new slab
    assert pool.stats().allocations == 2
    pool.release_tensor(small)
    mid = pool.tensor(600, torch.float32, torch.device("cpu"))  # fits the 4000-byte slab within 2x
    assert pool.stats().reuses == 1 and mid.untyped_storage().nbytes() == 4000
    mid.fill_(3.0)
    assert mid.shape == (600,) and torch.equal(mid, torch.full((600,), 3.0))
    pool.release_tensor(mid)
    pool.release_tensor(mid)  # a second release is a no-op
    assert pool.stats().lent_bytes == 0
    assert pool.trim() == 4000 + 400 and pool.stats().reserved_bytes == 0


def test_release_ignores_foreign_tensors_and_acquire_checks_input():
    pool = BufferPool()
    pool.release_tensor(torch.ones(4))
    assert pool.stats().reserved_bytes == 0
    with pytest.raises(RuntimeError, match="must be empty"):
        pool.acquire(torch.ones(4).untyped_storage(), 16)
    with pytest.raises(ValueError, match="max_waste"):
        BufferPool(max_waste=0.5)


def test_gradients_through_pooled_views_are_exact():
    """Autograd saves views of the buffer in forward; refilling the lent memory for backward works."""
    pool = BufferPool()
    buf = FlatBuffer(12, torch.float32, torch.device("cpu"), allocated=True, pool=pool)
    weight = torch.nn.Parameter(buf.view(0, (3, 4)))
    values = torch.randn(3, 4)
    buf.free()
    buf.allocate().copy_(values.flatten())
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autograd._unsafe_preserve_version_counter(buf.data):
        y = x @ weight.t()
    buf.free()
    other = pool.tensor(12, torch.float32, torch.device("cpu")).fill_(99.0)  # reuses the slab meanwhile
    pool.release_tensor(other)
    with torch.autograd._unsafe_preserve_version_counter(buf.data):
        buf.allocate().copy_(values.flatten())
    y.sum().backward()
    expected_x = torch.ones(2, 3) @ values
    assert torch.equal(x.grad, expected_x)


def test_release_between_steps_policy():
    keep, release = BufferPool(), BufferPool(keep_between_steps=False)
    for pool in (keep, release):
        pool.release_tensor(pool.tensor(100, torch.float32, torch.device("cpu")))
        pool.end_of_backward()
    assert keep.stats().reserved_bytes == 400 and release.stats().reserved_bytes == 0


@pytest.mark.parametrize("pooled", [True, False])
def test_an_abandoned_buffer_keeps_its_memory_for_good(pooled):
    """A buffer a failed collective may still write into is never freed, returned or reused."""
    pool = BufferPool(enabled=pooled)
    buf = FlatBuffer(10, torch.float32, torch.device("cpu"), pool=pool)
    data = buf.allocate()
    ptr = data.data_ptr()
    buf.abandon()
    buf.free()
    assert buf.allocated and data.untyped_storage().data_ptr() == ptr
    assert pool.stats().lent_bytes == (40 if pooled else 0)  # the slab stays on loan
    other = FlatBuffer(10, torch.float32, torch.device("cpu"), pool=pool).allocate()
    assert other.data_ptr() != ptr  # not lent to anyone else
    with pytest.raises(RuntimeError, match="abandoned"):
        buf.allocate()


def test_a_buffer_dropped_while_on_loan_is_not_counted_as_lent():
    """A model deleted with its weights gathered frees the memory with it; the pool's counters follow."""
    import gc

    pool = BufferPool()
    kept = FlatBuffer(10, torch.float32, torch.device("cpu"), pool=pool)
    kept.allocate()
    kept.free()  # one free slab, stays reserved
    dropped = FlatBuffer(10, torch.float32, torch.device("cpu"), pool=pool)
    dropped.allocate()
    other = FlatBuffer(100, torch.float32, torch.device("cpu"), pool=pool)
    other.allocate()  # a second slab, lent
    del other
    gc.collect()
    stats = pool.stats()
    assert (stats.lent_bytes, stats.reserved_bytes, stats.slabs) == (40, 40, 1), stats
    dropped.free()
    assert pool.stats().lent_bytes == 0 and pool.stats().reserved_bytes == 40

"""Checks of the performance aids: profiler ranges, the buffer pool (see harness)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp import EngineOptions, fully_shard
from megatron_fsdp.comm.profiling import RANGE_NAMES
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.memory import allocator
from megatron_fsdp.memory.allocator import default_pool
from tests.distributed.core.engine_checks import shard_net, world
from tests.distributed.harness import check
from tests.models import Block, Net, local_batch, loss_fn

SUITE = "perf"
WIDTH = 256  # large enough that unit buffers dwarf Python's own allocations in RSS


class Stack(nn.Module):
    """Equal blocks, each a unit, like a transformer's layers."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# The pool on whatever MEGATRON_FSDP_BUFFER_POOL says (python -m tests.soak runs with it off).
POOLED = EngineOptions(buffer_pool=True)


def sharded_stack(options: EngineOptions | None = None) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model, options=options)  # handed down to the blocks' units


def train_steps(model: nn.Module, steps: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    rank, _ = world()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def unit_bytes(model: nn.Module) -> list[int]:
    """Bytes of each unit's unsharded parameters (one flat buffer per group)."""
    out = []
    for module in model.modules():
        unit = getattr(module, "fsdp_unit", None)
        if unit is not None and unit.module is module:
            out.append(sum(g.layout.total_numel * g.compute_shard.element_size() for g in unit.groups))
    return out


def peak_rss_increase(run) -> int:
    """Peak resident memory during ``run()`` above the resident memory before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    run()
    return _status("VmHWM") - base


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


@contextlib.contextmanager
def pool_disabled():
    """Plain allocations (resize_), as before the pool existed."""
    assert default_pool().lent_bytes == 0
    saved, allocator._swap = allocator._swap, None
    try:
        yield
    finally:
        allocator._swap = saved


@check(SUITE, world_sizes=(2,))
def profiler_sees_named_ranges() -> None:
    rank, n = world()
    torch.manual_seed(0)
    model = shard_net(Net(), "optim_grads_params")
    loss_fn(model, local_batch(0, rank, n)).backward()  # records the forward order: the next step prefetches
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model, local_batch(1, rank, n)).backward()
    seen = {e.name for e in prof.events()}
    missing = [name for name in RANGE_NAMES if name not in seen]
    assert not missing, f"ranges missing from the trace: {missing}"
    counts = {name: sum(e.name == name for e in prof.events()) for name in RANGE_NAMES}
    units = 6  # root, probe, three blocks (one runs twice) ... reshard at least once per unit
    assert counts["megatron_fsdp.reshard"] >= units - 1, counts


@check(SUITE, world_sizes=(2,))
def pool_reuses_slabs_and_frees_idle_ones_after_forward() -> None:
    """After warm-up a forward allocates nothing; the forward's end gives the idle slabs back.

    The backward then takes at most the slabs of the unit it computes and the one it
    prefetches (1 + prefetch depth), the same number every step.
    """
    pool = default_pool()
    model = sharded_stack(POOLED)
    train_steps(model, 2)
    warm = pool.stats()
    new_slabs = []
    for step in range(3):
        before = pool.stats()
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(100 + step))
        loss = model(x).square().mean()
        after_forward = pool.stats()
        assert after_forward.allocations == before.allocations, (before, after_forward)
        assert after_forward.reserved_bytes == after_forward.lent_bytes == 0, after_forward  # root holds no weights
        loss.backward()
        new_slabs.append(pool.stats().allocations - after_forward.allocations)
        model.zero_grad()
    depth = max(unit.prefetch_depth for unit in units_of(model))
    assert len(set(new_slabs)) == 1 and 1 <= new_slabs[0] <= 1 + depth, new_slabs
    after = pool.stats()
    assert after.reuses > warm.reuses, (warm, after)
    assert after.lent_bytes == 0, after  # every gathered weight and gradient buffer came back
    largest = max(unit_bytes(model))
    everything = 2 * sum(unit_bytes(model))  # weights and gradients of every unit at once
    assert largest <= after.reserved_bytes < everything / 2, (largest, after.reserved_bytes, everything)
    pool.trim()


@check(SUITE, world_sizes=(2,))
def pool_keeps_numerics_and_memory() -> None:
    """Pooled and plain allocation train bitwise alike, and the pool does not raise peak memory."""
    default_pool().trim()
    plain, pooled = sharded_stack(POOLED), sharded_stack(POOLED)
    with pool_disabled():
        train_steps(plain, 1)  # warm-up, then measure
        plain_peak = peak_rss_increase(lambda: train_steps(plain, 3))
    train_steps(pooled, 1)
    pooled_peak = peak_rss_increase(lambda: train_steps(pooled, 3))
    for (name, a), b in zip(plain.named_parameters(), pooled.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    slack = max(unit_bytes(pooled)) // 2
    peaks = torch.tensor([plain_peak, pooled_peak])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # both ranks fail or pass together
    assert peaks[1] <= peaks[0] + slack, f"peak RSS increase: plain {peaks[0]}, pooled {peaks[1]} (slack {slack})"
    default_pool().trim()


@check(SUITE, world_sizes=(2,))
def pooled_gradients_match_unsharded_model() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Stack(3)
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, options=POOLED)
    xs = [torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(s)) for s in range(2 * n)]
    for step in range(2):
        mine = xs[step * n + rank]
        model(mine).square().mean().backward()
        full = torch.cat([xs[step * n + r] for r in range(n)])
        (reference(full).square().mean()).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
        model.zero_grad()
        reference.zero_grad()
    assert default_pool().lent_bytes == 0


@check(SUITE, world_sizes=(2,))
def gradient_buffers_are_reused_within_backward_and_dropped_after() -> None:
    model = sharded_stack()  # six equal block units under a root without parameters of its own
    spares = model.fsdp_unit.spares  # the root's: every unit under it shares them
    assert all(unit.spares is spares for unit in units_of(model))
    train_steps(model, 1)  # warm-up
    before = (spares.allocated, spares.reused)
    other = sharded_stack()  # a second model in the process keeps its own spares and counters
    train_steps(other, 1)
    assert other.fsdp_unit.spares is not spares and (spares.allocated, spares.reused) == before
    train_steps(model, 2)
    allocated, reused = spares.allocated - before[0], spares.reused - before[1]
    # Up to two reductions stay in flight, so the first three units of a backward allocate;
    # the other three take the buffers their reductions gave back.
    assert (allocated, reused) == (6, 6), (allocated, reused)
    assert spares.spare_count() == 0, "spare gradient buffers held between steps"


@check(SUITE, world_sizes=(2,))
def plain_optimizer_steps_on_local_shards_bitwise() -> None:
    """A plain AdamW over fully_shard-ed parameters steps on the local shards (optim/plain_local_step.py):
    bitwise the DTensor step's parameters and state; a subclass, or a step that raises, keeps DTensors."""
    from megatron_fsdp import fully_shard_optimizer
    from megatron_fsdp.optim import plain_local_step

    entered = []
    original = plain_local_step.on_local_shards

    def counting(optimizer):
        entered.append(type(optimizer).__name__)
        return original(optimizer)

    class ScaledAdamW(torch.optim.AdamW):  # a subclass may look across a tensor: never stepped locally
        pass

    plain_local_step.on_local_shards = counting
    try:
        models = [sharded_stack() for _ in range(3)]
        optimizers = [
            torch.optim.AdamW(models[0].parameters(), lr=0.01),
            fully_shard_optimizer(torch.optim.AdamW(models[1].parameters(), lr=0.01), step_on_local_shards=False),
            ScaledAdamW(models[2].parameters(), lr=0.01),
        ]
        for model, optimizer in zip(models, optimizers):
            train_steps(model, 3, optimizer)
    finally:
        plain_local_step.on_local_shards = original
    assert entered == ["AdamW", "AdamW"], entered  # steps 2 and 3 of the plain AdamW; step 1 creates state
    for other in (models[1], models[2]):
        for (name, a), b in zip(models[0].named_parameters(), other.parameters()):
            assert torch.equal(a.to_local(), b.to_local()), name
    for a, b in zip(optimizers[0].state.values(), optimizers[1].state.values()):
        for key in a:
            assert type(a[key]) is type(b[key]), key  # DTensors again after the step
            assert torch.equal(getattr(a[key], "_local_tensor", a[key]), getattr(b[key], "_local_tensor", b[key]))

    def failing_closure_free_step(*_):
        raise RuntimeError("boom")

    model, optimizer = models[0], optimizers[0]
    model(torch.randn(16, WIDTH)).square().mean().backward()
    handle = optimizer.register_step_post_hook(failing_closure_free_step)
    try:
        optimizer.step()
    except RuntimeError as error:
        assert "boom" in str(error)
    handle.remove()
    state = optimizer.state_dict()["state"]  # puts the DTensors back
    assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    assert all(isinstance(v, DTensor) for s in state.values() for k, v in s.items() if k != "step")

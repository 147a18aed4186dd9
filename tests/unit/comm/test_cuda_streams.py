"""CUDA side streams and the buffer pool's stream events at world size 1. Skips cleanly without a GPU."""


import pytest
import torch
import torch.distributed as dist

from megatron_fsdp.comm.streams import CUDA_STREAMS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL")


def test_collectives_run_from_side_streams_and_order_after_producers(nccl_group):
    from megatron_fsdp.comm import collectives

    group = dist.group.WORLD
    shard = torch.empty(1 << 20, device="cuda")
    out = torch.empty_like(shard)
    torch.cuda._sleep(50_000_000)  # a slow producer: the gather must not read before the fill
    shard.fill_(3.0)
    collectives.all_gather(out, shard, group).wait()
    assert torch.equal(out, torch.full_like(out, 3.0))
    grads = torch.empty(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    grads.fill_(2.0)
    reduced = torch.empty_like(grads)
    collectives.reduce_scatter(reduced, grads, group).wait()
    assert torch.equal(reduced, grads)
    assert {"all_gather", "reduce_scatter"} <= CUDA_STREAMS.kinds()
    device = torch.device("cuda", torch.cuda.current_device())
    assert all(CUDA_STREAMS.side(kind, device) != torch.cuda.current_stream() for kind in CUDA_STREAMS.kinds())


def test_consumer_waits_on_the_side_stream_event_not_the_host(nccl_group):
    """FSDP2's scheme at world size 1: the collective still goes through the side stream.

    A long sleep queued on the side stream before the collective proves the order: the
    host gets the handle back at once (nothing blocked), the event is not reached yet, and
    work the consumer queues after ``wait()`` runs only after the event.
    """
    from megatron_fsdp.comm.collectives import all_gather
    from megatron_fsdp.comm.streams import StreamWork

    device = torch.device("cuda", torch.cuda.current_device())
    side = CUDA_STREAMS.side("all_gather", device)
    shard = torch.full((1 << 20,), 5.0, device=device)
    out = torch.zeros_like(shard)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s or more: the collective queues behind it
    pending = all_gather(out, shard, dist.group.WORLD)
    (work,) = pending._works
    assert isinstance(work, StreamWork) and not work.is_completed(), "the host waited for the side stream"
    pending.wait()  # the consumer (current stream) waits on the event; the host does not
    after = torch.cuda.Event()
    after.record()
    assert not after.query(), "work queued by the consumer after wait() ran before the collective"
    after.synchronize()
    assert work.event.query()
    assert torch.equal(out, shard)


def test_hsdp_style_chain_runs_outer_after_inner_without_the_consumer(nccl_group):
    """The outer collective waits on the inner one's event on its own stream; the consumer waits at the end only."""
    from megatron_fsdp.comm.collectives import OUTER_STREAM, all_reduce, reduce_scatter

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    grads = torch.full((1 << 20,), 2.0, device=device)
    inner = torch.empty_like(grads)
    partial = torch.full_like(grads, 0.25)
    torch.cuda.synchronize()
    with torch.cuda.stream(CUDA_STREAMS.side("reduce_scatter", device)):
        torch.cuda._sleep(200_000_000)  # the inner stage finishes late
    first = reduce_scatter(inner, grads, group)
    second = all_reduce(inner, group, stream=OUTER_STREAM, after=first, accumulate=partial)
    marker = torch.cuda.Event()
    marker.record()  # compute queued now is not held back by the chain
    marker.synchronize()
    assert not first._works[0].is_completed() and not second._works[0].is_completed()
    second.wait()
    first.wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(inner, torch.full_like(inner, 2.25))


def test_pool_orders_reuse_after_last_user(nccl_group):
    from megatron_fsdp.memory.allocator import BufferPool

    pool = BufferPool()
    first = pool.tensor(1 << 20, torch.float32, torch.device("cuda"))
    torch.cuda._sleep(50_000_000)
    first.fill_(1.0)
    pool.release_tensor(first)  # records an event after the fill on the current stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        second = pool.tensor(1 << 20, torch.float32, torch.device("cuda"))  # side waits for the event
        second.add_(1.0)  # sees the finished fill: 2.0 everywhere
    torch.cuda.current_stream().wait_stream(side)
    assert pool.stats().reuses == 1
    assert torch.equal(second, torch.full_like(second, 2.0))
    pool.release_tensor(second)
    assert pool.trim() == 4 << 20


def test_sharded_training_with_pool_and_streams_matches_plain_model(nccl_group):
    import copy

    from megatron_fsdp import fully_shard
    from megatron_fsdp.memory.allocator import default_pool

    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    for step in range(3):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m in (model, plain):
            m(x).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    assert default_pool().lent_bytes == 0


def test_all_gather_does_not_queue_behind_a_reduce_scatter_of_another_group(nccl_group):
    """A prefetch all-gather overtakes a late reduce-scatter: different side streams and process groups.

    The engine reduces on a copy of the shard group (core/schedule.py), so the two kinds run
    on different NCCL communicators and internal streams (docs/design.md section 5b). A
    reduce-scatter held back by a long sleep on its side stream must not delay an all-gather
    issued after it.
    """
    from megatron_fsdp.comm.collectives import all_gather, reduce_scatter

    device = torch.device("cuda", torch.cuda.current_device())
    reduce_group = dist.new_group([0])
    grads = torch.ones(1 << 20, device=device)
    reduced = torch.empty_like(grads)
    shard = torch.full((1 << 20,), 7.0, device=device)
    gathered = torch.empty_like(shard)
    torch.cuda.synchronize()
    with torch.cuda.stream(CUDA_STREAMS.side("reduce_scatter", device)):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s or more
    late = reduce_scatter(reduced, grads, reduce_group)
    prefetch = all_gather(gathered, shard, dist.group.WORLD)
    prefetch._works[0].event.synchronize()  # the all-gather finished ...
    assert not late._works[0].is_completed(), "the all-gather waited behind the reduce-scatter"  # ... first
    prefetch.wait()
    late.wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(gathered, shard) and torch.equal(reduced, grads)

"""CUDA side streams and the buffer pool's stream events at world size 1. Skips cleanly without a GPU."""


import pytest
import torch
import torch.distributed as dist

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
    streams = {kind for kind, _ in collectives._side_streams}
    assert streams == {"all_gather", "reduce_scatter"}
    assert all(s != torch.cuda.current_stream() for s in collectives._side_streams.values())


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

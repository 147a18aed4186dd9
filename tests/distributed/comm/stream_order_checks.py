"""The engine on the side-stream path (FSDP2's scheme), on gloo with recording stand-in streams.

``tests/fake_streams.RecordingStreams`` sends every engine collective down the path CUDA
takes (issued synchronously on a side stream, an event recorded there, the consumer
waiting on the event), with CPU tensors. The numbers must equal the plain CPU path's bit
for bit (same collectives, same order of sums) and DDP's within the engine suites'
tolerance; the log must show the order FSDP2 relies on:

- every event a side stream records is waited on by the consumer (nothing left dangling),
  and ``works_in_flight()`` is 0 after every step;
- HSDP (issue 17 item 4): each outer reduction (all-reduce, or reduce-scatter under
  ``outer_sharding_strategy="optim"``) runs on the ``outer`` stream, chained behind its
  inner reduce-scatter's event, and the compute stream waits for it only at the drain,
  after the last inner reduction of the backward was issued, never at once;
- outer 'optim': the inner all-gather's stream waits on the outer all-gather's event
  instead of the compute stream waiting for it.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import EngineOptions, fully_shard
from megatron_fsdp.comm.collectives import works_in_flight
from tests.distributed.core.engine_checks import assert_close_params, world
from tests.distributed.harness import check, device_type
from tests.fake_streams import Op, RecordingStreams, use_streams
from tests.models import Net, local_batch, loss_fn

SUITE = "stream_order"
# The gloo fast paths bypass the side-stream path (they are CPU-only); the plain run keeps
# them off too, so both issue the same collectives.
OPTIONS = EngineOptions(gloo_fast_paths=False)


def shard(model: Net, **kwargs) -> Net:
    for block in model.blocks:
        fully_shard(block, options=OPTIONS, **kwargs)
    fully_shard(model.probe, options=OPTIONS, **kwargs)
    return fully_shard(model, options=OPTIONS, **kwargs)


def train(model: torch.nn.Module, steps: int, on_step=None) -> None:
    rank, n = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss_fn(model, local_batch(step, rank, n)).backward()
        if on_step is not None:
            on_step(step)
        opt.step()
        opt.zero_grad()
        assert works_in_flight() == 0, f"step {step}: {works_in_flight()} work(s) never waited for"


def waited_events(streams: RecordingStreams) -> set[str]:
    return {op.other for op in streams.log if op.what == "wait_event"}


def recorded_events(streams: RecordingStreams) -> set[str]:
    return {op.other for op in streams.log if op.what == "record"}


def compare_with_plain_and_ddp(streams: RecordingStreams, steps: int = 3, on_step=None, **kwargs) -> None:
    torch.manual_seed(0)
    base = Net()
    ours, plain = shard(copy.deepcopy(base), **kwargs), shard(copy.deepcopy(base), **kwargs)
    use_streams(ours, streams)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    train(ours, steps, on_step)
    train(plain, steps)
    train(ddp, steps)
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):  # the same layout: shard by shard
        assert torch.equal(p.to_local(), q.to_local()), f"side-stream path vs plain path: {name} differs"
    assert_close_params(ours, ddp.module, exact=False, rtol=0, atol=1e-6, what="side-stream path vs DDP")
    dangling = recorded_events(streams) - waited_events(streams)
    assert not dangling, f"side-stream events nobody waited on: {sorted(dangling)}"


@check(SUITE, world_sizes=(2, 4), params={"strategy": ("optim_grads_params", "optim_grads", "optim")})
def side_stream_path_matches_plain(strategy: str) -> None:
    streams = RecordingStreams()
    compare_with_plain_and_ddp(streams, sharding_strategy=strategy)
    kinds = {op.stream for op in streams.ops(what="record")}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds
    # every collective's stream waited for the compute stream (the producer) before it ran
    for kind in kinds:
        since_exit: list[Op] = []
        for op in streams.ops(kind):
            if op.what == "enter":
                assert Op(kind, "wait_stream", "compute") in since_exit, (kind, since_exit)
            since_exit = [] if op.what == "exit" else [*since_exit, op]


def check_outer_waited_at_drain(streams: RecordingStreams) -> None:
    """Per backward: compute waits on 'outer' events only after the last inner reduction was issued."""
    log = streams.log
    inner_issues = [i for i, op in enumerate(log) if op.stream == "reduce_scatter" and op.what == "record"]
    assert len(inner_issues) > 2, "too few reductions to tell a drain from a wait at once"
    backward = min(inner_issues)  # before it: the forward (outer 'optim': its outer all-gathers)
    outer_waits = [i for i, op in enumerate(log) if i > backward and op == Op("compute", "wait_event", op.other)
                   and op.other.startswith("outer#")]
    outer_records = [i for i, op in enumerate(log) if i > backward and op.stream == "outer" and op.what == "record"]
    assert outer_waits and len(outer_waits) >= len(inner_issues), (len(outer_waits), len(inner_issues))
    last_issue = max(inner_issues)
    assert min(outer_waits) > last_issue, (
        f"the compute stream waited for an outer reduction at op {min(outer_waits)}, before the last inner "
        f"reduction was issued (op {last_issue}): waited at once, not at the drain")
    # each outer reduction is chained behind an inner reduce-scatter's event on the outer stream
    for i in outer_records:
        own = [op for op in log[:i] if op.stream == "outer"]
        since = own[len(own) - 1 - next(k for k, op in enumerate(reversed(own)) if op.what == "wait_stream"):]
        assert any(op.what == "wait_event" and op.other.startswith("reduce_scatter#") for op in since), since


@check(SUITE, world_sizes=(4,), params={"outer": ("replicate", "optim")})
def hsdp_outer_reduction_chained_and_waited_at_drain(outer: str) -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    kwargs = {"mesh": mesh, "sharding_strategy": "optim_grads_params"}
    if outer == "optim":
        kwargs["outer_sharding_strategy"] = "optim"
    streams = RecordingStreams()

    def after_backward(step: int) -> None:
        check_outer_waited_at_drain(streams)
        if outer == "optim":
            # the inner all-gather's stream waited on the outer all-gather's event (chained)
            gathers = [i for i, op in enumerate(streams.log) if op.stream == "all_gather" and op.what == "wait_event"
                       and op.other.startswith("outer#")]
            assert gathers, "the inner all-gathers were not chained after the outer all-gather"
        streams.log.clear()

    compare_with_plain_and_ddp(streams, on_step=after_backward, **kwargs)

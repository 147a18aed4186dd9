"""The side-stream path of the collectives (FSDP2's scheme), checked on CPU with recording stand-in streams.

One gloo rank: the collectives really run (synchronously, as NCCL's would be issued), and
``tests/fake_streams.RecordingStreams`` logs every stream operation around them. What is
checked is what FSDP2's ``foreach_all_gather`` / ``foreach_reduce`` rely on: the side stream
waits for the producer before the collective, the collective is issued synchronously inside
the side stream's context, an event is recorded there, the consumer waits on that event only
when the handle is waited for, and the tensors stay referenced until then.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megatron_fsdp.comm import collectives
from megatron_fsdp.comm.collectives import (
    OUTER_STREAM,
    REDUCE_STREAM,
    CommConfig,
    Pending,
    all_gather,
    all_reduce,
    reduce_scatter,
    works_in_flight,
)
from megatron_fsdp.comm.streams import CUDA_STREAMS, StreamWork
from tests.fake_streams import Op, RecordingStreams


@pytest.fixture
def streams() -> RecordingStreams:
    return RecordingStreams()


def comm_with(streams: RecordingStreams) -> CommConfig:
    return CommConfig(gloo_fast_paths=False, streams=streams)


def test_all_gather_is_issued_on_its_side_stream_and_the_consumer_waits_on_its_event(gloo_rank, streams):
    shard = torch.arange(6.0)
    out = torch.empty(6)
    pending = all_gather(out, shard, gloo_rank, comm=comm_with(streams))
    assert streams.log == [
        Op("all_gather", "wait_stream", "compute"),  # ordered after the kernels that wrote the shard
        Op("all_gather", "enter"),
        Op("all_gather", "record", "all_gather#1"),  # recorded after the collective, on the side stream
        Op("all_gather", "exit"),
    ]
    # Issued synchronously: the handle holds the event, not an async dist.Work.
    assert [type(w) for w in pending._works] == [StreamWork]
    assert pending.in_flight and works_in_flight() == 1
    pending.wait()
    assert streams.log[-1] == Op("compute", "wait_event", "all_gather#1")
    assert torch.equal(out, shard) and pending.done and works_in_flight() == 0


def test_tensors_stay_referenced_until_the_consumer_waited(gloo_rank, streams):
    grads, out = torch.ones(8), torch.empty(8)
    refs = weakref.ref(grads), weakref.ref(out)
    pending = reduce_scatter(out, grads, gloo_rank, comm=comm_with(streams))
    del grads, out
    gc.collect()
    assert all(r() is not None for r in refs), "freed while the side stream may still use them"
    assert Op("compute", "wait_event", "reduce_scatter#1") not in streams.log
    pending.wait()
    gc.collect()
    assert all(r() is None for r in refs), "still held after the consumer waited"
    assert streams.log[-1] == Op("compute", "wait_event", "reduce_scatter#1")


def test_chained_collective_waits_on_the_producer_event_not_the_consumer(gloo_rank, streams):
    comm = comm_with(streams)
    grads, inner = torch.full((4,), 2.0), torch.empty(4)
    first = reduce_scatter(inner, grads, gloo_rank, comm=comm)
    partial = torch.full((4,), 0.5)
    second = all_reduce(inner, gloo_rank, comm=comm, stream=OUTER_STREAM, after=first, accumulate=partial)
    outer_ops = streams.ops("outer")
    assert outer_ops == [
        Op("outer", "wait_stream", "compute"),
        Op("outer", "wait_event", "reduce_scatter#1"),  # chained on the device, behind the inner stage
        Op("outer", "enter"),
        Op("outer", "record", "outer#2"),
        Op("outer", "exit"),
    ]
    assert not streams.ops("compute", "wait_event"), "the consumer must not wait when the chain is issued"
    assert first.in_flight and second.in_flight  # the producer keeps its tensors until its own wait
    second.wait()
    first.wait()
    assert streams.ops("compute", "wait_event") == [Op("compute", "wait_event", "outer#2"),
                                                     Op("compute", "wait_event", "reduce_scatter#1")]
    assert torch.equal(inner, torch.full((4,), 2.5))  # the partial sum went in before the all-reduce


def test_after_without_streams_is_waited_for_first(gloo_rank):
    log: list[str] = []

    class Work:
        def wait(self) -> bool:
            log.append("producer waited")
            return True

    producer = Pending(Work())
    tensor = torch.ones(3)
    pending = all_reduce(tensor, gloo_rank, after=producer)  # CPU, no streams: the async path
    assert log == ["producer waited"] and producer.done
    assert not any(isinstance(w, StreamWork) for w in pending._works)
    pending.wait()


def test_take_over_moves_the_producer_works_to_the_consumer_handle(gloo_rank, streams):
    comm = comm_with(streams)
    producer = all_gather(torch.empty(2), torch.ones(2), gloo_rank, comm=comm)
    consumer = all_gather(torch.empty(2), torch.ones(2), gloo_rank, comm=comm, after=producer)
    consumer.take_over(producer)
    assert producer.done and not producer.in_flight and len(consumer._works) == 2
    consumer.wait()
    assert [op.other for op in streams.ops("compute", "wait_event")] == ["all_gather#2", "all_gather#1"]
    assert works_in_flight() == 0


def test_cpu_without_stand_ins_keeps_the_async_path(gloo_rank):
    out = torch.empty(4)
    pending = all_gather(out, torch.ones(4), gloo_rank, comm=CommConfig(gloo_fast_paths=False))
    assert pending._works and not any(isinstance(w, StreamWork) for w in pending._works)
    pending.wait()
    assert torch.equal(out, torch.ones(4))


def test_which_collectives_take_side_streams():
    assert CommConfig().stream_provider(torch.device("cpu")) is None
    assert CommConfig().stream_provider(torch.device("cuda", 0)) is CUDA_STREAMS
    assert CommConfig(side_streams=False).stream_provider(torch.device("cuda", 0)) is None
    fake = RecordingStreams()
    assert CommConfig(streams=fake).stream_provider(torch.device("cpu")) is fake
    assert CommConfig(side_streams=False, streams=fake).stream_provider(torch.device("cpu")) is None
    assert (collectives.GATHER_STREAM, REDUCE_STREAM, OUTER_STREAM) == ("all_gather", "reduce_scatter", "outer")


def test_a_failed_issue_leaves_nothing_in_flight(gloo_rank, streams):
    out = torch.empty(3)  # not world * shard numel: the collective raises while issuing
    with pytest.raises((RuntimeError, ValueError)):
        all_gather(out, torch.ones(2), gloo_rank, comm=comm_with(streams))
    assert works_in_flight() == 0
    assert streams.ops("all_gather", "exit"), "the side stream context was left"

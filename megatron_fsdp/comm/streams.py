"""Side streams and events for collectives on CUDA, the way PyTorch FSDP2 orders them.

Why not ``async_op=True`` from a side stream: ProcessGroupNCCL runs an async collective on
its own internal stream and ``work.wait()`` makes whichever stream calls it wait, so the
side stream it was issued from takes no part in the ordering. FSDP2
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_all_gather`` and
``foreach_reduce``) instead issues the collective synchronously (``async_op=False``) inside
``with torch.cuda.stream(side)``: it then lands in the side stream's queue (launched on the
current stream since pytorch/pytorch#150398, joined back into it before), an event
recorded on the side stream marks its end, the consumer stream waits on that event (a
device-side wait: the host never blocks), and the tensors the collective reads or writes
are kept referenced until the consumer has waited (FSDP2's ``AllGatherState`` /
``ReduceScatterState`` / ``AllReduceState``; ProcessGroupNCCL no longer keeps the tensors
of synchronous collectives alive). This module
does the same through a small interface, ``StreamProvider``, so that the order of
operations can be checked on CPU with stand-in streams (tests/unit/comm/).

Rules every caller keeps (docs/design.md section 5b):

- a side stream first waits for the stream that produced its inputs (the current one
  when the collective is issued), and for the events of any collective it chains after;
- tensors are allocated on the consumer stream, never inside the side stream's context,
  so that memory freed later is only reused by work ordered after the consumer's wait;
- a ``StreamWork`` holds the tensors until ``wait()`` made the consumer stream wait on
  its event; only then may they be freed, returned to the pool or read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Event(Protocol):
    """What the engine needs of ``torch.cuda.Event``."""

    def query(self) -> bool: ...


class Stream(Protocol):
    """What the engine needs of ``torch.cuda.Stream``."""

    def wait_stream(self, stream: Stream) -> None: ...

    def wait_event(self, event: Event) -> None: ...

    def record_event(self) -> Event: ...


class StreamProvider(Protocol):
    """Where side streams come from: CUDA's (``CUDA_STREAMS``), or stand-ins in tests."""

    def current(self, device: torch.device) -> Stream:
        """The stream work is queued on now (the producer at issue time, the consumer at wait time)."""
        ...

    def side(self, kind: str, device: torch.device) -> Stream:
        """The dedicated stream of one kind of collective on ``device`` (made once, then reused)."""
        ...

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the current one inside the block."""
        ...


class CudaStreams:
    """CUDA's streams: one side stream per kind and device, as FSDP2's ``FSDPCommContext`` has one per kind.

    FSDP2 gives its all-gather and reduce-scatter streams high priority (so their
    copies are not delayed behind compute) and the HSDP all-reduce stream default
    priority; so do we.
    """

    HIGH_PRIORITY_KINDS = ("all_gather", "reduce_scatter")

    def __init__(self) -> None:
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}

    def current(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def side(self, kind: str, device: torch.device) -> torch.cuda.Stream:
        if device.index is None:  # "cuda" and "cuda:<current>" are one device: one stream of each kind
            device = torch.device("cuda", torch.cuda.current_device())
        key = (kind, device)
        stream = self._streams.get(key)
        if stream is None:
            priority = -1 if kind in self.HIGH_PRIORITY_KINDS else 0
            stream = self._streams[key] = torch.cuda.Stream(device=device, priority=priority)
        return stream

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def kinds(self) -> set[str]:
        """The kinds of side stream made so far (for tests)."""
        return {kind for kind, _ in self._streams}


CUDA_STREAMS = CudaStreams()  # process-wide, as the CUDA streams themselves are per device


class StreamWork:
    """A collective issued synchronously on a side stream: ``Pending`` holds it like a ``dist.Work``.

    ``wait()`` makes the stream current at the time of the call (the consumer) wait on
    ``event`` and then drops the tensors, which were kept referenced so that the
    caching allocator could not hand their memory to other work before the collective
    finished. The host never blocks.
    """

    def __init__(self, provider: StreamProvider, device: torch.device, event: Event,
                 tensors: tuple[torch.Tensor, ...]) -> None:
        self.provider = provider
        self.device = device
        self.event = event
        self.tensors = tensors

    def wait(self) -> bool:
        self.provider.current(self.device).wait_event(self.event)
        self.tensors = ()
        return True

    def is_completed(self) -> bool:
        """Whether the device finished the collective (never blocks)."""
        return self.event.query()


@contextlib.contextmanager
def on_side_stream(provider: StreamProvider, kind: str, device: torch.device,
                   after: tuple[Event, ...] = ()) -> Iterator[Stream]:
    """Run the block on ``kind``'s side stream, ordered after the current stream and ``after``'s events."""
    stream = provider.side(kind, device)
    stream.wait_stream(provider.current(device))
    for event in after:
        stream.wait_event(event)
    with provider.use(stream):
        yield stream

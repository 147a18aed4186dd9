"""Stand-in CUDA streams and events that record every stream operation, for CPU tests of the ordering.

``RecordingStreams`` implements ``megatron_fsdp.comm.streams.StreamProvider``; passed as
``CommConfig.streams`` it sends collectives on CPU tensors down the side-stream path (issued
synchronously inside the side stream's context, an event recorded there, the consumer waiting
on it), so the order of operations FSDP2's scheme needs can be asserted without a GPU. The
log is a list of ``Op(stream, what, other)``:

- ``Op("all_gather", "wait_stream", "compute")``: a stream waits for another stream's queue;
- ``Op("compute", "wait_event", "reduce_scatter#3")``: a stream waits for an event;
- ``Op("outer", "record", "outer#4")``: an event recorded on a stream;
- ``Op("outer", "enter", "")`` / ``Op("outer", "exit", "")``: the stream made current and back.

Events report completion as ``completed`` says (all done by default: the CPU collectives
ran synchronously).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from megatron_fsdp.core.lookup import units_of


@dataclasses.dataclass(frozen=True)
class Op:
    stream: str
    what: str
    other: str = ""


class FakeEvent:
    def __init__(self, name: str, owner: RecordingStreams) -> None:
        self.name, self.owner = name, owner

    def query(self) -> bool:
        return self.owner.completed


class FakeStream:
    def __init__(self, name: str, owner: RecordingStreams) -> None:
        self.name, self.owner = name, owner

    def wait_stream(self, stream: FakeStream) -> None:
        self.owner.log.append(Op(self.name, "wait_stream", stream.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.owner.log.append(Op(self.name, "wait_event", event.name))

    def record_event(self) -> FakeEvent:
        self.owner.events += 1
        event = FakeEvent(f"{self.name}#{self.owner.events}", self.owner)
        self.owner.log.append(Op(self.name, "record", event.name))
        return event


class RecordingStreams:
    """A ``StreamProvider`` whose streams and events only record what is done with them."""

    def __init__(self) -> None:
        self.log: list[Op] = []
        self.events = 0
        self.completed = True
        self.compute = FakeStream("compute", self)
        self._sides: dict[str, FakeStream] = {}
        self._current: list[FakeStream] = [self.compute]

    def current(self, device: torch.device) -> FakeStream:
        return self._current[-1]

    def side(self, kind: str, device: torch.device) -> FakeStream:
        if kind not in self._sides:
            self._sides[kind] = FakeStream(kind, self)
        return self._sides[kind]

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        self._current.append(stream)
        self.log.append(Op(stream.name, "enter"))
        try:
            yield
        finally:
            self._current.pop()
            self.log.append(Op(stream.name, "exit"))

    def ops(self, stream: str | None = None, what: str | None = None) -> list[Op]:
        """The log, filtered by stream and/or kind of operation."""
        return [op for op in self.log if (stream is None or op.stream == stream) and (what is None or op.what == what)]


def use_streams(model: nn.Module, streams: RecordingStreams) -> None:
    """Run every unit under the root ``model`` with ``streams`` as its side streams (before its first forward)."""
    units = units_of(model)
    comm = dataclasses.replace(units[0].comm, streams=streams)
    for unit in units:
        unit.comm = comm
        for group in unit.groups:
            group.use(comm, unit.pool, unit.spares)

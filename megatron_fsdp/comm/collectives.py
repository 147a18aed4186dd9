"""The one module that calls ``torch.distributed``: device-agnostic, counted.

Every collective the engine issues goes through here, so that ``comm_stats``
can report exactly how many bytes each kind of collective moved. Each call takes a
``CommConfig`` (built per root from its ``EngineOptions``): the gloo fast paths and
CUDA side streams to use, and the root's own ``CommStats`` to record into as well. Byte counts
are the logical payload: an all-gather counts its output, a reduce-scatter its
input, an all-reduce its tensor (the ZeRO accounting of docs/design.md section 7). HSDP with
an outer ``optim`` strategy counts its collectives across ``dp_outer`` apart,
as ``all_gather_outer`` and ``reduce_scatter_outer``.

Gradients are averaged by scaling before a SUM collective rather than with
``ReduceOp.AVG``: gloo and NCCL then give identical numbers, and the result is
bitwise what ``DistributedDataParallel`` computes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_fsdp.comm.lending import on_aliases, return_lent, wait_lent
from megatron_fsdp.comm.streams import CUDA_STREAMS, Event, StreamProvider, StreamWork, on_side_stream

# torch 2.13 renamed the flat-tensor collectives; 2.11 only has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes and calls per collective kind since the last ``reset``.

    ``group_bytes``/``group_calls``: the same per process group, keyed by the group's
    ``group_name`` (e.g. an HSDP model's ``dp_outer`` traffic apart from its ``dp_shard``
    traffic); collectives recorded without their group are not in them.
    """

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    group_bytes: Counter = field(default_factory=Counter)
    group_calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        size = tensor.numel() * tensor.element_size()
        self.bytes[kind] += size
        self.calls[kind] += 1
        if group is not None:
            self.group_bytes[group.group_name] += size
            self.group_calls[group.group_name] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.group_bytes.clear()
        self.group_calls.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


comm_stats = CommStats()  # every collective of the process (the public ``megatron_fsdp.comm_stats``)


@dataclass(frozen=True)
class CommConfig:
    """How one root's collectives run, passed to each call (built from its ``EngineOptions``).

    ``stats``: the root's own ``CommStats``, recorded into besides the process-wide
    ``comm_stats``, so that two models in one process can be measured apart.
    """

    gloo_fast_paths: bool = True
    side_streams: bool = True
    stats: CommStats | None = None
    # Where side streams come from; None: CUDA's, for tensors on a CUDA device (stand-ins in tests).
    streams: StreamProvider | None = None

    def stream_provider(self, device: torch.device) -> StreamProvider | None:
        """The side streams collectives on ``device`` run on, or None (off, or no streams: CPU)."""
        if not self.side_streams:
            return None
        if self.streams is not None:
            return self.streams
        return CUDA_STREAMS if device.type == "cuda" else None

    def record(self, kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        comm_stats.record(kind, tensor, group)
        if self.stats is not None:
            self.stats.record(kind, tensor, group)


DEFAULT_COMM = CommConfig()  # the defaults; counted in ``comm_stats`` only


class Work(Protocol):
    """What ``Pending`` holds: ``torch.distributed``'s async work handle, or anything with ``wait()``."""

    def wait(self) -> object: ...


class Pending:
    """Collectives in flight, and what to do once they land (``then``).

    Note (memory safety, relied on by ``ParamGroup`` and ``RootState``): a work leaves
    the handle only when its own ``wait()`` has returned, so while a handle holds works
    the tensors they read or write may still be in use and must not be freed or reused.
    ``wait()`` waits for every work even when one of them fails and then re-raises the
    first error. A handle that failed stays failed for good: it keeps the works whose
    wait raised (a failed NCCL work may still run on its stream), never runs ``then``,
    and every later ``wait()`` raises again; its owner abandons the buffers involved.
    A successful ``wait()`` is idempotent.
    """

    def __init__(self, work: Work | list[Work] | None = None, then: Callable[[], None] | None = None) -> None:
        self._works: list[Work] = []
        self._then = then
        self.error: BaseException | None = None  # the first failure; set once, never cleared
        for w in [] if work is None else work if isinstance(work, list) else [work]:
            self.add(w)

    def add(self, work: Work) -> None:
        """Hold one more issued work (called right after issuing it, so no error path can lose it)."""
        self._works.append(work)
        if self.error is None:
            _in_flight.add(self)

    def take_over(self, other: Pending | None) -> None:
        """Hold ``other``'s works from now on, to be waited for with this handle's (a chained producer).

        Used when a collective was ordered after ``other`` on the device (``after=``): whoever
        waits for the consumer's result then also waits on the producer's events, which
        releases the tensors the producer holds. ``other`` is left empty (``done`` if it was
        not failed; a failed one keeps its error and is not taken over).
        """
        if other is None or other.error is not None:
            return
        works, other._works = other._works, []
        _in_flight.discard(other)
        for work in works:
            self.add(work)

    def wait(self) -> None:
        """Wait for every work, then run ``then``; re-raise the first failure (see the class note)."""
        if self.error is not None:
            raise RuntimeError(
                f"a collective of this handle failed earlier ({self.error!r}); its buffers are abandoned"
            ) from self.error
        error = self._wait_works()
        if error is not None:
            self._fail(error)
            raise error
        then, self._then = self._then, None
        if then is not None:
            try:
                then()
            except Exception as exc:
                self._fail(exc)
                raise

    def _wait_works(self) -> Exception | None:
        """Wait for each work, dropping it once its wait returned; the first error, if any."""
        first: Exception | None = None
        i = 0
        while i < len(self._works):
            try:
                self._works[i].wait()
            except Exception as exc:  # keep it (it may still run) and wait for the others
                if first is None:
                    first = exc
                i += 1
                continue
            del self._works[i]
        if not self._works:
            _in_flight.discard(self)
        return_lent()
        return first

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        _in_flight.discard(self)  # its owner keeps it (and the abandoned buffers) for good

    @property
    def done(self) -> bool:
        """Everything landed and ``then`` ran: the buffers involved are free to reuse."""
        return not self._works and self._then is None and self.error is None

    @property
    def landed(self) -> bool:
        """Every work completed (checked without waiting); ``wait()`` then returns at once."""
        return all(work_completed(w) for w in self._works)

    @property
    def in_flight(self) -> bool:
        """Some work has not been waited for successfully: its buffers must not be freed or reused."""
        return bool(self._works)

    @property
    def failed(self) -> bool:
        return self.error is not None


def work_completed(work: object) -> bool:
    """Whether ``work`` finished, checked without waiting.

    ``is_completed()`` first. Torch's fake process group (one rank of an N-rank job
    simulated) runs every collective at issue, but its works answer ``is_completed()``
    ``False`` for ever; their future is done, which is what a work whose collective
    completed at issue shows. Without this, anything that waits for a work to land by
    polling (``core/state.py``) spent its whole time budget on every such work.
    """
    is_completed = getattr(work, "is_completed", None)
    if is_completed is None or is_completed():
        return True
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return False
    try:
        return bool(get_future().done())
    except RuntimeError:  # a backend without futures
        return False


# Every handle holding works nobody has waited for yet (failed ones excluded: their
# owners keep them). Strong references: a handle dropped without a wait stays here, so
# a lost work shows up in ``works_in_flight()`` instead of vanishing.
_in_flight: set[Pending] = set()


def works_in_flight() -> int:
    """Works issued through this module and not yet waited for (0 between steps: nothing outlives its pass)."""
    return sum(len(p._works) for p in _in_flight)


@contextlib.contextmanager
def _issuing(pending: Pending) -> Iterator[None]:
    """Issue works into ``pending``; if issuing raises, wait for those already issued before re-raising.

    Afterwards ``pending`` is failed and, unless a wait failed too, holds no work, so
    the caller may free the buffers; if it still holds works they are abandoned.
    """
    try:
        yield
    except BaseException as exc:
        issued = len(pending._works)
        error = pending._wait_works()
        pending._fail(exc)
        if issued and hasattr(exc, "add_note"):
            left = len(pending._works)
            exc.add_note(
                f"megatron_fsdp.collectives: {issued} work(s) issued before this error were waited for"
                + (f"; {left} failed too ({error!r}) and still hold their buffers" if left else "")
            )
        raise


# CommConfig.gloo_fast_paths: gloo (CPU) only, both on by default; both keep the bytes and the numbers of the
# plain collectives (checked by tests at 2 and 4 ranks):
# - all-gather as one broadcast per rank: gloo's ring all-gather runs its steps one
#   after the other on one thread, while the broadcasts run on the group's worker
#   threads side by side (1.4-1.6x faster measured at 2 and 4 ranks);
# - reduce-scatter over 2 ranks as one exchange: each rank sends the half the other keeps
#   and adds the half it receives into its own. gloo implements reduce-scatter as a whole
#   all-reduce on a copy of the input, which sends twice these bytes; a + b == b + a in IEEE
#   arithmetic, so the sums are bit for bit those of the all-reduce (8.5 against 20.6 ms for
#   a 7 MiB buffer on this project's 2-core machine);
# - over more ranks, a gradient buffer that dies afterwards as an in-place all-reduce plus
#   a copy of this rank's slice (gloo's own reduce-scatter without its copy of the input;
#   an exchange would sum in another order than the all-reduce and than DDP).
def _is_gloo(tensor: torch.Tensor, group: dist.ProcessGroup, comm: CommConfig) -> bool:
    return comm.gloo_fast_paths and tensor.device.type == "cpu" and str(dist.get_backend(group)) == "gloo"


# CommConfig.side_streams (CUDA): each kind of collective runs on a side stream of its own, FSDP2's way
# (comm/streams.py): issued synchronously inside the side stream's context, an event recorded
# there, the consumer stream waiting on the event when the ``Pending`` is waited for, the
# tensors referenced until then. Streams: "all_gather" (weights), "reduce_scatter" (gradients,
# the reductions inside dp_shard) and "outer" (every collective across dp_outer under HSDP:
# FSDP2's all_reduce_stream), so that neither kind waits behind the other nor behind compute
# queued after it. Reductions also run on a process group of their own (core/schedule.py),
# hence on another NCCL communicator and internal stream than the all-gathers: the two kinds
# never serialise inside NCCL either. CPU/gloo work has no streams: the async work handles give
# the overlap there.
GATHER_STREAM, REDUCE_STREAM, OUTER_STREAM = "all_gather", "reduce_scatter", "outer"


def _after_events(after: Pending | None, streams: bool) -> tuple[Event, ...]:
    """What a collective chained after ``after`` must be ordered behind.

    On side streams: the events of ``after``'s stream works (the side stream waits on them; the
    host and the consumer do not). Any other work of ``after`` (and all of it off streams) is
    waited for here, which orders the consumer stream (CUDA) or the host (gloo) behind it.
    """
    if after is None:
        return ()
    if streams and all(isinstance(w, StreamWork) for w in after._works) and after.error is None:
        return tuple(w.event for w in after._works)
    after.wait()
    return ()


def _issue(pending: Pending, comm: CommConfig, stream: str | None, device: torch.device,
           tensors: tuple[torch.Tensor, ...], after: Pending | None,
           collective: Callable[[bool], dist.Work | None]) -> Pending:
    """Issue ``collective(async_op)`` into ``pending``: on ``stream``'s side stream if streams apply, else async.

    ``tensors``: what the collective reads or writes, held until the consumer waited.
    ``after``: a handle whose collectives must finish before this one starts (see ``_after_events``).
    """
    provider = comm.stream_provider(device) if stream is not None else None
    events = _after_events(after, provider is not None)
    if provider is None:
        with _issuing(pending):
            pending.add(collective(True))
        return pending
    with on_side_stream(provider, stream, device, events) as side, _issuing(pending):
        collective(False)
        pending.add(StreamWork(provider, device, side.record_event(), tensors))
    return pending


def _check_no_alias(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
    # A collective writing into its own input corrupts data silently.
    if output.numel() and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise RuntimeError(f"{what}: output aliases input")


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    kind: str = "all_gather",
    into: Pending | None = None,
    comm: CommConfig = DEFAULT_COMM,
    stream: str = GATHER_STREAM,
    after: Pending | None = None,
) -> Pending:
    """Gather equal flat shards from every rank of ``group`` into ``output`` (counted under ``kind``).

    ``into``: a handle the caller already holds, which receives each work as it is
    issued, so that after an error the caller still sees what may be writing into
    ``output`` (see ``_issuing``). Returns that handle (or a new one).
    ``stream``: the side stream it runs on (CUDA); ``after``: a handle whose collectives
    produce ``shard``, chained after without waiting where streams allow (``_after_events``).
    """
    _check_no_alias(output, shard, "all_gather")
    pending = Pending() if into is None else into
    comm.record(kind, output, group)
    world = dist.get_world_size(group)
    if world > 1 and _is_gloo(output, group, comm):
        _after_events(after, False)
        n = shard.numel()
        output.narrow(0, dist.get_rank(group) * n, n).copy_(shard)
        with _issuing(pending):
            for r in range(world):
                src = dist.get_global_rank(group, r)
                pending.add(on_aliases(dist.broadcast, output.narrow(0, r * n, n), src=src, group=group, async_op=True))
        return pending
    return _issue(pending, comm, stream, output.device, (output, shard), after,
                  lambda async_op: on_aliases(_all_gather_flat, output, shard, group=group, async_op=async_op))


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    kind: str = "reduce_scatter",
    input_is_scratch: bool = False,
    comm: CommConfig = DEFAULT_COMM,
    stream: str = REDUCE_STREAM,
    after: Pending | None = None,
) -> Pending:
    """Sum ``input`` over ``group`` and leave this rank's equal slice in ``output`` (counted under ``kind``).

    ``input_is_scratch``: the caller never reads ``input`` again, so on gloo it may be
    summed in place (see ``CommConfig.gloo_fast_paths``). ``stream``, ``after``: as for ``all_gather``.
    """
    _check_no_alias(output, input, "reduce_scatter")
    comm.record(kind, input, group)
    if _is_gloo(input, group, comm) and dist.get_world_size(group) == 2:
        _after_events(after, False)
        return _exchange_halves(output, input, group)
    if input_is_scratch and _is_gloo(input, group, comm):
        _after_events(after, False)
        n = output.numel()
        piece = input.narrow(0, dist.get_rank(group) * n, n)
        pending = Pending(then=lambda: output.copy_(piece))
        with _issuing(pending):
            pending.add(on_aliases(dist.all_reduce, input, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return pending
    return _issue(Pending(), comm, stream, input.device, (output, input), after,
                  lambda async_op: on_aliases(_reduce_scatter_flat, output, input, op=dist.ReduceOp.SUM, group=group,
                                                        async_op=async_op))


def _exchange_halves(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Reduce-scatter over a group of 2: send the peer its half of ``input``, receive ours into ``output``, add.

    An all-to-all with nothing sent to oneself rather than isend/irecv: gloo's point-to-point
    send writes from the calling thread and blocks it until the peer has posted its receive,
    which made every reduction wait for the slower rank (257 ms per step in the benchmark);
    the collective runs on the group's worker threads like the others.
    """
    n = output.numel()
    me = dist.get_rank(group)
    splits = [n, 0] if me == 1 else [0, n]
    mine = input.narrow(0, me * n, n)
    pending = Pending(then=lambda: output.add_(mine))
    with _issuing(pending):
        theirs = input.narrow(0, (1 - me) * n, n)
        pending.add(on_aliases(dist.all_to_all_single, output, theirs, output_split_sizes=splits,
                                           input_split_sizes=splits, group=group, async_op=True))
    return pending


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    comm: CommConfig = DEFAULT_COMM,
    stream: str | None = None,
    after: Pending | None = None,
    accumulate: torch.Tensor | None = None,
) -> Pending:
    """Sum ``tensor`` in place over ``group``.

    ``stream``: the side stream it runs on (CUDA; None: issued from the current stream, for
    callers that wait at once); ``after``: as for ``all_gather``. ``accumulate``: added into
    ``tensor`` first, on the same stream (HSDP's partial sums; FSDP2 accumulates on its
    reduction stream too) and held as long as ``tensor``.
    """
    comm.record("all_reduce", tensor, group)

    def issue(async_op: bool) -> dist.Work | None:
        if accumulate is not None:
            tensor.add_(accumulate)
        return on_aliases(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    kept = (tensor,) if accumulate is None else (tensor, accumulate)
    return _issue(Pending(), comm, stream, tensor.device, kept, after, issue)


def broadcast(
    tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup, *, comm: CommConfig = DEFAULT_COMM
) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank of ``group``."""
    comm.record("broadcast", tensor, group)
    src = dist.get_global_rank(group, src_rank)
    pending = Pending()
    with _issuing(pending):
        pending.add(on_aliases(dist.broadcast, tensor, src=src, group=group, async_op=True))
    return pending


def all_reduce_max(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, comm: CommConfig = DEFAULT_COMM, kind: str = "control"
) -> None:
    """Element-wise maximum of ``tensor`` over ``group``, in place, waited for (control rounds; the
    scales of a quantized all-gather, counted as ``kind``)."""
    comm.record(kind, tensor, group)
    wait_lent(dist.all_reduce, tensor, op=dist.ReduceOp.MAX, group=group)

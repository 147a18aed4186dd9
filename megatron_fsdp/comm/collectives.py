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

# torch 2.13 renamed the flat-tensor collectives; 2.11 only has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes and calls per collective kind since the last ``reset``."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

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

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        comm_stats.record(kind, tensor)
        if self.stats is not None:
            self.stats.record(kind, tensor)


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
        return all(getattr(w, "is_completed", lambda: True)() for w in self._works)

    @property
    def in_flight(self) -> bool:
        """Some work has not been waited for successfully: its buffers must not be freed or reused."""
        return bool(self._works)

    @property
    def failed(self) -> bool:
        return self.error is not None


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
# - reduce-scatter of a gradient buffer that dies afterwards as an in-place all-reduce
#   plus a copy of this rank's slice: gloo implements reduce-scatter as exactly that
#   all-reduce, on a copy of the input it allocates first (the same sums, bit for bit).
def _is_gloo(tensor: torch.Tensor, group: dist.ProcessGroup, comm: CommConfig) -> bool:
    return comm.gloo_fast_paths and tensor.device.type == "cpu" and str(dist.get_backend(group)) == "gloo"


# CommConfig.side_streams: CUDA only: one all-gather and one reduce-scatter stream per device. Issuing the
# weight gathers (prefetches included) and the gradient reductions from their own
# streams keeps them out of the compute stream's queue, so neither waits behind the
# other kind nor behind compute queued after it was issued; NCCL runs each on its
# internal stream ordered after the stream it was issued from. CPU/gloo work has no
# streams: the async work handles give the overlap there.
_side_streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


@contextlib.contextmanager
def side_stream(kind: str, device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Issue the collective inside from ``kind``'s dedicated CUDA stream (no-op off CUDA).

    Stream-safety rules kept here and by the callers:
    - the side stream first waits for the current (producer) stream, so the collective
      reads the shard or gradients only after the kernels that wrote them;
    - ``Pending.wait()`` runs on the consumer stream, which then waits for the
      collective, so outputs are read, and inputs freed or returned to the pool
      (``BufferPool.release`` records an event), only after it finished.
    """
    if device.type != "cuda" or not enabled:
        yield
        return
    key = (kind, device)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


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
) -> Pending:
    """Gather equal flat shards from every rank of ``group`` into ``output`` (counted under ``kind``).

    ``into``: a handle the caller already holds, which receives each work as it is
    issued, so that after an error the caller still sees what may be writing into
    ``output`` (see ``_issuing``). Returns that handle (or a new one).
    """
    _check_no_alias(output, shard, "all_gather")
    pending = Pending() if into is None else into
    comm.record(kind, output)
    world = dist.get_world_size(group)
    if world > 1 and _is_gloo(output, group, comm):
        n = shard.numel()
        output.narrow(0, dist.get_rank(group) * n, n).copy_(shard)
        with _issuing(pending):
            for r in range(world):
                src = dist.get_global_rank(group, r)
                pending.add(dist.broadcast(output.narrow(0, r * n, n), src=src, group=group, async_op=True))
        return pending
    with side_stream("all_gather", output.device, comm.side_streams), _issuing(pending):
        pending.add(_all_gather_flat(output, shard, group=group, async_op=True))
    return pending


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    kind: str = "reduce_scatter",
    input_is_scratch: bool = False,
    comm: CommConfig = DEFAULT_COMM,
) -> Pending:
    """Sum ``input`` over ``group`` and leave this rank's equal slice in ``output`` (counted under ``kind``).

    ``input_is_scratch``: the caller never reads ``input`` again, so on gloo it may be
    summed in place (see ``CommConfig.gloo_fast_paths``).
    """
    _check_no_alias(output, input, "reduce_scatter")
    comm.record(kind, input)
    if input_is_scratch and _is_gloo(input, group, comm):
        n = output.numel()
        piece = input.narrow(0, dist.get_rank(group) * n, n)
        pending = Pending(then=lambda: output.copy_(piece))
        with _issuing(pending):
            pending.add(dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return pending
    pending = Pending()
    with side_stream("reduce_scatter", input.device, comm.side_streams), _issuing(pending):
        pending.add(_reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return pending


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, comm: CommConfig = DEFAULT_COMM) -> Pending:
    """Sum ``tensor`` in place over ``group``."""
    comm.record("all_reduce", tensor)
    pending = Pending()
    with _issuing(pending):
        pending.add(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return pending


def broadcast(
    tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup, *, comm: CommConfig = DEFAULT_COMM
) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank of ``group``."""
    comm.record("broadcast", tensor)
    src = dist.get_global_rank(group, src_rank)
    pending = Pending()
    with _issuing(pending):
        pending.add(dist.broadcast(tensor, src=src, group=group, async_op=True))
    return pending


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup, *, comm: CommConfig = DEFAULT_COMM) -> None:
    """Element-wise maximum of ``tensor`` over ``group``, in place, waited for (control rounds)."""
    comm.record("control", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

"""Per-root runtime state: in-flight reductions and the end-of-backward callback.

The root is the outermost unit whose forward runs first. It owns what spans
units: the reductions still in flight (at most two, to bound memory) and the
callback the autograd engine runs once backward is over, which reduces what no
hook reduced, reshards everything and checks nothing was left behind.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from torch.autograd import Variable

from . import grad_buffers
from .allocator import default_pool
from .profiling import REDUCE_ISSUE, REDUCE_WAIT, trace_range

if TYPE_CHECKING:
    from .param_group import PendingReduce
    from .unit import FSDPUnit

MAX_REDUCES_IN_FLIGHT = 2


class RootState:
    """State shared by all units under one root."""

    def __init__(self, root: FSDPUnit, units: list[FSDPUnit]) -> None:
        self.root = root
        self.units = units
        self._in_flight: deque[PendingReduce] = deque()
        # 0 makes every reduction synchronous (Megatron's overlap_grad_reduce=False).
        self.max_in_flight: int = getattr(root, "max_reduces_in_flight", MAX_REDUCES_IN_FLIGHT)
        self._callback_queued = False
        # Units in the order their forward first ran, recorded every forward and
        # used by the next iteration to prefetch (all-gather ahead of use).
        self.forward_order: list[FSDPUnit] = []
        self._recording: list[FSDPUnit] = []
        # Set by the root's forward, cleared by the end of backward: still set at the
        # next forward means an optimizer step may have run without a backward.
        self._forward_without_backward = False
        for unit in units:
            unit.root_state = self

    def begin_forward(self) -> None:
        """The root's forward starts: weights kept by a forward no backward followed are stale."""
        if self._forward_without_backward:
            for unit in self.units:
                unit.mark_weights_stale()
        self._forward_without_backward = False

    def record_forward(self, unit: FSDPUnit) -> None:
        if unit is self.root:
            self._recording = []
        if unit not in self._recording:
            self._recording.append(unit)

    def end_forward(self) -> None:
        """The root's forward finished: its recorded order drives the next prefetches."""
        self.forward_order = self._recording
        self._forward_without_backward = True

    def prefetch_after(self, unit: FSDPUnit, direction: int) -> None:
        """Start the all-gathers of the units that run after ``unit`` (forward: +1, backward: -1)."""
        if unit not in self.forward_order:
            return
        index = self.forward_order.index(unit)
        for step in range(1, unit.prefetch_depth + 1):
            other = index + direction * step
            if 0 <= other < len(self.forward_order):
                self.forward_order[other].prefetch()

    def queue_final_callback(self) -> None:
        """Ask autograd to call ``finish_backward`` when this backward pass ends."""
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self.finish_backward)
            self._callback_queued = True

    def track(self, reduce: PendingReduce | None) -> None:
        """Keep a reduction in flight, finishing the oldest beyond the limit."""
        if reduce is None:
            return
        self._in_flight.append(reduce)
        while len(self._in_flight) > self.max_in_flight:
            self._finish_oldest()

    def drain(self) -> None:
        while self._in_flight:
            self._finish_oldest()
        grad_buffers.drop_all()  # spares serve one backward; none is held between steps

    def _finish_oldest(self) -> None:
        with trace_range(REDUCE_WAIT, self.root.device):
            reduce = self._in_flight.popleft()
            reduce.finish()
        if reduce.scratch is not None:  # the next unit's backward re-uses it
            grad_buffers.give_back(reduce.scratch)

    def finish_backward(self) -> None:
        """Reduce leftovers (hooks that never fired), wait, reshard, reset."""
        self._callback_queued = False
        self._forward_without_backward = False
        for unit in self.units:
            for group in unit.groups:
                if group.grads_pending:
                    with trace_range(REDUCE_ISSUE, unit.device):
                        reduce = group.reduce_grads(unit.reduces_now, unit.grad_scaling)
                    self.track(reduce)
        self.drain()
        step_may_follow = self.root.optimizer_step_may_follow
        for unit in self.units:
            unit.finish_backward()
        if step_may_follow:
            default_pool().end_of_backward()

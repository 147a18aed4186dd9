"""Per-root runtime state: in-flight reductions and the end-of-backward callback.

The root is the outermost unit whose forward runs first. It owns what spans
units: the order of their collectives (``schedule.CollectiveSchedule``), the
reductions still in flight (at most two, to bound memory) and the callback the
autograd engine runs once backward is over, which issues the reductions left,
waits for them and reshards everything.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch.autograd import Variable

from megatron_fsdp.comm.profiling import REDUCE_WAIT, trace_range
from megatron_fsdp.core.group_grads import PendingReduce
from megatron_fsdp.core.schedule import CollectiveSchedule

if TYPE_CHECKING:  # the unit owns its RootState: annotations only
    from megatron_fsdp.core.unit import FSDPUnit

LANDING_WAIT_S = 0.05


def _landed_within(reduce: PendingReduce, seconds: float) -> bool:
    """Poll ``reduce`` until it finished or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while not reduce.poll():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


class RootState:
    """State shared by all units under one root."""

    def __init__(self, root: FSDPUnit, units: list[FSDPUnit]) -> None:
        self.root = root
        self.units = units
        self._in_flight: deque[PendingReduce] = deque()
        self._zeros_only: list[PendingReduce] = []  # finished, install decided at the end of backward
        self._outer_in_flight: list[PendingReduce] = []  # inner stage waited for; chained outer stage runs on
        # 0 makes every reduction synchronous (Megatron's overlap_grad_reduce=False).
        self.max_in_flight: int = root.options.max_reduces_in_flight
        self._callback_queued = False
        # Set by the root's forward, cleared by the end of backward: still set at the
        # next forward means an optimizer step may have run without a backward.
        self._forward_without_backward = False
        for unit in units:
            unit.root_state = self
        self.schedule = CollectiveSchedule(units, self.track)

    def begin_forward(self) -> None:
        """The root's forward starts: weights kept by a forward no backward followed are stale."""
        if self._forward_without_backward:
            for unit in self.units:
                unit.mark_weights_stale()
        self._forward_without_backward = False
        self._release_dropped_grads()
        # reshard_after_forward=N: this forward's gathers store the post-forward shard,
        # decided here once for every rank alike (core/post_forward_shard.py).
        keep = torch.is_grad_enabled()
        for unit in self.units:
            for group in unit.groups:
                group.keep_post_forward = keep and unit.reshard_after_forward and unit is not self.root
        self.schedule.begin_forward()

    def record_forward(self, unit: FSDPUnit) -> None:
        self.schedule.record_use(unit)

    def need_weights(self, unit: FSDPUnit) -> None:
        """Gather ``unit``'s weights (in the order every rank issues them) and wait for them."""
        self.schedule.need_weights(unit)

    def end_forward(self) -> None:
        """The root's forward finished: close the phase with every rank (core/schedule.py)."""
        self.schedule.end_forward([unit.forward_grad_calls > 0 for unit in self.units])
        for unit in self.units:
            for group in unit.groups:
                group.keep_post_forward = False
        self._forward_without_backward = True
        if torch.is_grad_enabled():
            self.root.pool.end_of_forward()  # the step's peak follows: idle slabs would add to it
        else:
            # No backward follows (evaluation): the modules hold their sharded
            # parameters again, so that model.parameters() (e.g. an optimizer built
            # now) sees them, not gathered copies.
            for unit in self.units:
                unit.reshard()

    def begin_backward(self) -> None:
        """A unit's backward starts: the first one of this backward pass opens the phase."""
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self.finish_backward)
            self._callback_queued = True
            self._release_dropped_grads()
            self.schedule.begin_backward()

    def _release_dropped_grads(self) -> None:
        """Drop the sharded ``main_grad`` aliases of gradients ``zero_grad()`` set to None.

        A plain torch optimizer's ``zero_grad(set_to_none=True)`` cannot know of the alias, which
        would otherwise keep last step's sharded gradients (a whole model's worth) alive through
        this step's forward and backward, on top of its peak (docs/performance.md).
        """
        for unit in self.units:
            for group in unit.groups:
                group.sync_sharded_main_grads()

    def track(self, reduce: PendingReduce | None) -> None:
        """Keep a reduction in flight, finishing the oldest beyond the limit.

        Where waiting blocks the host (gloo), the oldest is waited for at most
        ``LANDING_WAIT_S`` and otherwise left in flight: another rank may be waiting
        for this one in a control round (core/schedule.py) before it can issue its part
        of that reduction. On CUDA a wait only orders streams and never blocks; a reduction
        whose HSDP outer stage is chained on its own stream (``PendingReduce.chained``) gives
        its buffer back after the inner stage, and its outer stage is waited for at the drain.
        """
        if reduce is None:
            return
        self._in_flight.append(reduce)
        while len(self._in_flight) > self.max_in_flight:
            oldest = self._in_flight[0]
            if oldest.output.device.type == "cpu" and not _landed_within(oldest, LANDING_WAIT_S):
                return
            self._finish_oldest(drain=False)

    def drain(self) -> None:
        self._in_flight.extendleft(reversed(self._outer_in_flight))  # the older ones first
        self._outer_in_flight = []
        while self._in_flight:
            self._finish_oldest()
        self.root.spares.drop_all()  # spares serve one backward; none is held between steps

    def _finish_oldest(self, drain: bool = True) -> None:
        with trace_range(REDUCE_WAIT, self.root.device):
            reduce = self._in_flight.popleft()
            unit = self.schedule.unit_of[id(reduce.group)]
            with self.schedule.waiting_for(f"the gradient reduction of {self.schedule.describe(unit)}"):
                if reduce.chained and not drain:
                    reduce.finish_inner()
                else:
                    reduce.finish()
        if reduce.chained and not drain:
            self._outer_in_flight.append(reduce)
        elif reduce.defer_install:
            self._zeros_only.append(reduce)
        if reduce.scratch is not None:  # the next unit's backward re-uses it
            self.root.spares.give_back(reduce.scratch)
            reduce.scratch = None

    def finish_backward(self) -> None:
        """Issue the reductions left (in the agreed order), wait, install, reshard, reset."""
        self._callback_queued = False
        self._forward_without_backward = False
        had_grads, kept, used = self.schedule.end_backward()
        self.drain()
        for reduce in self._zeros_only:
            # zeros from here; install only if another rank had gradients (else None, as DDP)
            if had_grads[self.schedule.group_index[id(reduce.group)]] and reduce.result is not None:
                reduce.group.install_grads(reduce.result)
        self._zeros_only = []
        for group, used_here in zip(self.schedule.groups, used):
            if group.reduced_this_backward or group.fresh_grads:  # a reduction decided; else no_sync goes on
                group.drop_unused_fresh_grads(used_here)
        step_may_follow = self.root.optimizer_step_may_follow
        for unit, keep in zip(self.units, kept):
            unit.finish_backward(keep_weights=keep)
            for group in unit.groups:
                group.sync_sharded_main_grads()
        if step_may_follow:
            self.root.pool.end_of_backward()

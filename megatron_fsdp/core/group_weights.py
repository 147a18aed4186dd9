"""The weight path of a ``ParamGroup``: gather and reshard, as a state machine.

A group is ``SHARDED`` (modules hold the sharded DTensor parameters) or ``UNSHARDED``
(modules hold views of the gathered flat buffer). ``start_unshard`` issues the
all-gather of the compute shard into the flat buffer (``FlatBuffer``), ``wait_gather``
waits for it, ``finish_unshard`` installs the views, ``reshard`` installs the sharded
parameters again and frees the buffer; a gather that failed keeps its buffer abandoned
(docs/design.md section 9). ``refresh_compute`` keeps the compute shard (what the
all-gather sends: a cast copy of the main shard, or under HSDP outer 'optim' the
dp_shard-sized shard gathered across ``dp_outer``) current after an optimizer step.

``WeightPath`` is a mixin of ``ParamGroup`` (``core/param_group.py``), which builds the
storage it reads: ``shard``, ``compute_shard``, ``unsharded``, ``layout``, ``refs``,
``sharded_params``, ``unsharded_params``, ``comm``, ``post_forward``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.comm.collectives import Pending, all_gather
from megatron_fsdp.core.gather_extension import GATHER_DTYPE
from megatron_fsdp.core.offload import upload
from megatron_fsdp.core.quantized_gather import GATHER_DTYPE as QUANTIZED_DTYPE
from megatron_fsdp.sharding.outer_shard import gather_compute_shard


class GroupState(enum.Enum):
    SHARDED = "sharded"  # modules hold the sharded DTensor parameters
    UNSHARDED = "unsharded"  # modules hold views of the gathered flat buffer


class WeightPath:
    """The group's gather/reshard state machine and its compute shard (a mixin of ``ParamGroup``)."""

    def mark_compute_stale(self) -> None:
        """The main weights may change (an optimizer step may follow): refresh before next use.

        The post-forward shard is dropped too: it is a piece of the old weights.
        """
        self.post_forward_piece = None
        if self.compute_shard is not None and self.compute_shard is not self.shard:
            self.compute_stale = True

    def refresh_compute(self, chain: bool = False) -> Pending | None:
        """Copy (cast) the main shard into the compute shard, if it is stale.

        ``chain``, on side streams only: return the outer all-gather (outer 'optim') still in
        flight, for the inner all-gather to be chained after it (``all_gather(after=)``);
        otherwise it is waited for here.
        """
        pending = None
        if self.compute_stale:
            with torch.no_grad():
                if self.outer is not None:
                    pending = gather_compute_shard(self.compute_shard, self.shard, self.dp, comm=self.comm)
                    if not (chain and self.comm.stream_provider(self.device) is not None):
                        pending.wait()
                        pending = None
                else:
                    self.compute_shard.copy_(self.shard)
                    self.uploads += self.offload is not None
            self.compute_stale = False
            self.refreshes += 1
        return pending

    def start_compute_refresh(self) -> None:
        """The root's forward: refresh a stale compute shard here, in unit order, where every rank is.

        Outer 'optim' refreshes with a blocking all-gather across ``dp_outer``; issued at a
        unit's first gather instead, a rank that skipped units would reach it at another point
        than its peers (deadlock). On side streams it stays in flight, and this group's inner
        all-gather is chained after it (``_gather_input``); elsewhere it is waited for at once.
        """
        self.settle_compute_refresh()
        self._outer_refresh = self.refresh_compute(chain=True)

    def settle_compute_refresh(self) -> None:
        """Wait for an outer refresh no all-gather consumed (a unit that did not run), before the
        main shard it reads can change (the optimizer step) or another refresh writes its output."""
        if self._outer_refresh is not None:
            self._outer_refresh.wait()
            self._outer_refresh = None

    def _gather_input(self) -> tuple[torch.Tensor, dist.ProcessGroup, str, Pending | None]:
        """What this rank sends in the group's all-gather, over which group, counted as which kind.

        The post-forward piece within its sub-group if one is stored (the same on every
        rank, see ``core/post_forward_shard.py``); else the compute shard over the shard
        group, under CPU offload a fresh upload of the host shard. Last: the outer
        all-gather still filling the compute shard (side streams only), to chain after.
        """
        if self.post_forward_piece is not None:
            return self.post_forward_piece, self.post_forward.group, "all_gather_post_forward", None
        if self.extension is not None:  # the hooks' payload, read from the sharded parameters
            return self.extension.gather_input(), self.process_group, "all_gather", None
        if self.quantized is not None:  # float8 of the main weights (gather_dtype)
            return self.quantized.gather_input(self.shard, self.comm), self.process_group, "all_gather", None
        refresh = self.refresh_compute(chain=True)
        if refresh is None:  # the one started at the root's forward, if still in flight
            refresh, self._outer_refresh = self._outer_refresh, None
        if self.compute_shard is None:
            self.uploads += 1
            return upload(self.shard, self.compute_dtype, self.device), self.process_group, "all_gather", None
        return self.compute_shard, self.process_group, "all_gather", refresh

    def _store_piece_after(self, source: torch.Tensor, gathered: torch.Tensor) -> Callable[[], None] | None:
        """What to run once a gather into ``gathered`` landed: store the post-forward piece, if wanted."""
        if not self.keep_post_forward or self.post_forward is None or source is self.post_forward_piece:
            return None
        return partial(self._store_piece, gathered)

    def _store_piece(self, gathered: torch.Tensor) -> None:
        numel = self.layout.total_numel // self.post_forward.size
        self.post_forward_piece = gathered.narrow(0, self.post_forward.position * numel, numel).clone()

    def participate(self) -> Pending:
        """Issue this group's all-gather into scratch: the data is not needed here, the pairing is.

        The same collective ``start_unshard`` issues (group, kind, size), so ranks that
        use the weights and ranks that only take part pair up.
        """
        source, group, kind, refresh = self._gather_input()
        if self.extension is not None:  # the hooks' payload, as bytes
            scratch = torch.empty(self.extension.total_numel, dtype=GATHER_DTYPE, device=self.device)
        elif self.quantized is not None:
            scratch = torch.empty(self.quantized.total_numel, dtype=QUANTIZED_DTYPE, device=self.device)
        else:
            scratch = torch.empty(self.layout.total_numel, dtype=self.compute_dtype, device=self.device)
        pending = Pending(then=self._store_piece_after(source, scratch))
        try:
            return all_gather(scratch, source, group, kind=kind, into=pending, comm=self.comm, after=refresh)
        finally:
            pending.take_over(refresh)  # waiting for the gather waits for what filled its input

    def start_unshard(self) -> None:
        """Issue the all-gather of the weights (no-op if unsharded, in flight or landed)."""
        if self.state is GroupState.UNSHARDED or self._gather is not None:
            return
        for index in range(len(self.refs)):  # a replaced parameter's values go into the shard before it is read
            self._check_not_replaced(index)
        if not self.gathers or self.post_forward_piece is not None:
            self.refresh_compute()  # a stored post-forward piece is gathered instead, but stays current
        if not self.gathers:
            return
        source, group, kind, refresh = self._gather_input()
        data = self.unsharded.allocate()
        # Refilling the weights in place for backward bumps the version counter
        # that autograd saved in forward; the values are the same ones forward
        # used, so the counter is restored once the gather lands.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(data)
        target, then = data, self._store_piece_after(source, data)
        if self.quantized is not None:  # float8 bytes land beside the weights, dequantized into them
            target = torch.empty(self.quantized.total_numel, dtype=QUANTIZED_DTYPE, device=self.device)
            then = partial(self.quantized.dequantize_into, target, data)
        # Registered before issuing: whatever happens below, the works stay in sight.
        self._gather = Pending(then=then)
        try:
            try:
                all_gather(target, source, group, kind=kind, into=self._gather, comm=self.comm, after=refresh)
            finally:
                self._gather.take_over(refresh)  # waiting for the gather waits for what filled its input
        except BaseException:
            if self._gather.in_flight:
                self.unsharded.abandon()  # a failed work may still write into it; _gather stays failed
            else:  # all_gather waited for what it had issued: nothing writes into the buffer
                self._gather = None
                self._version_guard.__exit__(None, None, None)
                self.unsharded.free()
            raise

    @property
    def gather_in_flight(self) -> bool:
        """An all-gather was issued and not yet waited for (or it failed: see ``wait_gather``)."""
        return self._gather is not None and not self._gather.done

    def wait_gather(self) -> None:
        """Wait for this group's all-gather, if one is in flight; its weights stay gathered.

        A gather that landed is installed by the next ``finish_unshard`` without gathering
        again, or freed by ``reshard``. If the gather failed, its error is raised here and
        by every later unshard or reshard, and the gathered buffer is abandoned: never
        freed nor reused, since a failed work may still write into it.
        """
        pending = self._gather
        if pending is None or pending.done:
            return
        try:
            pending.wait()
        except BaseException:
            if pending.failed:
                self.unsharded.abandon()
            raise
        self._version_guard.__exit__(None, None, None)

    def finish_unshard(self) -> None:
        """Wait for the all-gather and point the modules at the unsharded views."""
        if self.state is GroupState.UNSHARDED:
            return
        self.start_unshard()
        self.wait_gather()
        self._gather = None
        if self.extension is not None:  # the post-hooks: this gather's metadata (torchao: the scale)
            self.extension.refresh(self.unsharded_params, self.unsharded.data)
        self._install(self.unsharded_params)
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Point the modules back at the sharded parameters and free the gathered weights.

        A prefetch nobody consumed is waited for first: memory a collective may still
        write into is never freed (the heap corruption of docs/design.md section 9).
        """
        self.wait_gather()
        self._gather = None
        if self.state is GroupState.UNSHARDED:
            self._install(self.sharded_params)
            self.state = GroupState.SHARDED
        if self.unsharded is not None:
            self.unsharded.free()

    def _install(self, params: list[nn.Parameter], *, check: bool = True) -> None:
        """Point every use at ``params``; ``check``: first refuse a parameter replaced behind our back
        (``parallelize_module`` after ``fully_shard``), which installing would silently undo, and carry
        a ``requires_grad`` set on the parameter shown until now over to the one shown next (a unit
        gathered without running its forward, e.g. skipped in a micro-batch, would hide it)."""
        if check:
            self.follow_requires_grad()
        for i in range(len(self.refs)) if check else ():
            self._check_not_replaced(i)  # may take a replacement over: sharded_params[i] is then the new one
        for ref, param in zip(self.refs, params):
            for module, name in ref.uses:
                module._parameters[name] = param

"""The gradient path of a ``ParamGroup``: take, accumulate, reduce, install.

Gradients not reduced yet live in three places (docs/design.md, "Gradients"): autograd's
tensors (``_stash``), the ``main_grad`` buffer fused wgrad kernels write
(``contribution``), and what earlier backwards accumulated without a reduction
(``grad_buffer``). ``reduce_grads`` takes them into one flat buffer and reduce-scatters
(or all-reduces) it into this rank's shard; ``PendingReduce`` carries the collective, its
HSDP outer stage, and installs the result as the sharded parameters' ``.grad``.

``GradientPath`` is a mixin of ``ParamGroup`` (``core/param_group.py``), which builds the
storage and geometry it reads (``layout``, ``params``, ``sharded_params``,
``unsharded_params``, ``dp``, ``plan``, ``outer``, ``comm``, ``spares``, the dtypes);
``_init_grads`` sets its own state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.comm.collectives import OUTER_STREAM, REDUCE_STREAM, Pending, all_reduce, reduce_scatter
from megatron_fsdp.core.grad_scaling import GradScaling
from megatron_fsdp.core.offload import download


@dataclass
class PendingReduce:
    """A gradient reduction in flight and where its result lands."""

    group: GradientPath  # the ParamGroup whose gradients these are
    work: Pending
    output: torch.Tensor  # this rank's reduced shard, flat
    scratch: torch.Tensor | None = None  # the full gradient buffer, reusable once this lands
    # Only zeros went in from here: install the result only if another rank had
    # gradients (decided by the root at the end of backward, see core/schedule.py).
    defer_install: bool = False
    result: torch.Tensor | None = None  # the reduced main-shard part, once finished
    _outer: tuple[Pending, torch.Tensor] | None = None  # HSDP: the reduction across dp_outer
    # On side streams (CUDA) the outer stage is issued at once, chained on its own stream
    # behind the inner one with events (FSDP2's all_reduce_stream); the consumer waits for
    # it at the drain only (end of backward, before the optimizer), see ``finish_inner``.
    chained: bool = False
    defer_outer: bool = False  # HSDP: hold the outer stage (a non-last micro-batch), see reduce_grads

    def chain_outer(self) -> None:
        """Issue the outer (dp_outer) stage now, ordered after the inner one on the device, not the host."""
        self._outer = self.group.start_outer_reduction(self.output, after=self.work, defer=self.defer_outer)
        self.chained = True

    def finish_inner(self) -> None:
        """Wait for the inner reduction only: its input (``scratch``) may be reused; the outer stage runs on."""
        self.work.wait()

    def finish(self) -> None:
        """Wait for the reduction (and its outer stage) and install the gradients."""
        self._advance(block=True)

    def poll(self) -> bool:
        """Advance as far as landed collectives allow, without waiting; True once finished.

        Chained: True once the inner stage landed, waiting for nothing (the outer stage is
        waited for at the drain).
        """
        if self.chained:
            return self.work.landed
        return self._advance(block=False)

    def _advance(self, block: bool) -> bool:
        if self.result is not None:
            return True
        if self._outer is None:
            if not block and not self.work.landed:
                return False
            self.work.wait()
            self._outer = self.group.start_outer_reduction(self.output, defer=self.defer_outer)
        work, reduced = self._outer
        if not block and not (work.landed and self.work.landed):
            return False
        self.work.wait()  # chained: the inner stage was not waited for yet (no-op otherwise)
        work.wait()
        self.result = reduced
        if not self.defer_install and reduced is not None:  # None: held back (set_requires_all_reduce(False))
            self.group.install_grads(reduced)
        return True


class GradientPath:
    """The group's gradients from autograd's hooks to the sharded ``.grad`` (a mixin of ``ParamGroup``)."""

    def _init_grads(self, on_grads_ready: Callable[[GradientPath], None]) -> None:
        """The gradient bookkeeping of a new group (no gradient yet)."""
        self._on_grads_ready = on_grads_ready
        # Gradients not reduced yet live in three places (docs/design.md, "Gradients"):
        # - _stash: this backward's gradients as autograd made them, by parameter index, copied
        #   into a flat buffer only when reduced: no full-size buffer (nor zero-filling) for the
        #   whole backward, which for a tied embedding (whose gradient comes last) is all of it;
        # - contribution: the flat buffer behind main_grad, made zeroed by get_main_grad() for
        #   fused wgrad kernels, which write it (Megatron-LM overwrites, TransformerEngine adds);
        #   one per backward, so an overwrite never loses an earlier backward's gradient;
        # - grad_buffer: what earlier backwards accumulated without a reduction (no_sync).
        self.grad_buffer: torch.Tensor | None = None
        self.contribution: torch.Tensor | None = None
        self._stash: dict[int, torch.Tensor] = {}
        self._stash_owned: set[int] = set()  # stashed tensors made here (sums), safe to add into in place
        # Who received what, and when each record is cleared. They look alike but differ in
        # lifetime, and each decides something else, so they are kept apart (a merge into one
        # "received since the last reduction" set changes results in edge cases: a second
        # gradient arriving while the first reduction is in flight, a zeros-only reduction
        # whose install the root skips, a gradient added to main_grad by a fused kernel only):
        # - _unreduced: parameters a gradient was accumulated for (``_accumulate``) since the
        #   last reduction started; moved into _reducing when one starts. With _reducing, the
        #   parameters install_grads installs besides the trainable ones: a parameter frozen
        #   after some micro-batches keeps what they accumulated (as .grad does in plain PyTorch).
        # - _reducing: those of the reductions started and not installed yet (kept across a
        #   reduction whose install the root skipped).
        # - used_since_sync: parameters whose gradient hook fired (a fused kernel's main_grad
        #   included) since the last install decision (``drop_unused_fresh_grads``), no_sync
        #   micro-batches included: which .grad a rank may drop (core/state.py).
        # - fresh_grads: parameters whose .grad the last installs created.
        # - _grads_seen: parameters whose hook fired in this backward since the group was last
        #   complete (``grads_complete``: every trainable parameter's gradient arrived).
        # - holds_grads: a gradient arrived since the group was last reduced or dropped (a
        #   parameter whose output is unused never gets one); received_grads: in this backward.
        self._unreduced: set[int] = set()
        self._reducing: set[int] = set()
        self.used_since_sync: set[int] = set()
        self.fresh_grads: set[int] = set()
        self._grads_seen: set[int] = set()
        self.holds_grads = False
        self.reduced_this_backward = False
        self.received_grads = False
        self.grads_complete = False
        # Reductions run on a copy of process_group (core/schedule.py), so that they never
        # interleave with all-gathers differently on different ranks.
        self.reduce_process_group: dist.ProcessGroup = self.process_group
        # HSDP, set_requires_all_reduce(False) or a non-last microbatch (``defer_outer`` of
        # reduce_grads): the dp_shard-reduced gradients are summed here, in grad_dtype, instead
        # of being reduced across dp_outer; the next outer reduction adds them in (docs/design.md,
        # "HSDP").
        self.requires_all_reduce = True
        self.partial_outer: torch.Tensor | None = None

    def _slot_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        return self.params[index].slot_view(buffer)

    def main_grad_of(self, index: int) -> torch.Tensor:
        """The ``main_grad`` of parameter ``index``: a view of this backward's ``contribution`` buffer.

        The unsharded parameters' ``get_main_grad``: Megatron-LM's layers and TransformerEngine
        call it (in backward, or in forward) instead of reading ``main_grad`` when
        ``__fsdp_param__`` is set, and write the weight gradient into it. The buffer is made
        zeroed at the first call of a backward and sets ``main_grad`` on every trainable
        parameter of the group; it is folded into the gradients at the end of that backward
        (or its reduction), so what forward took is what backward fills.
        """
        if index not in self._grad_indices:
            raise RuntimeError(f"get_main_grad() of parameter '{self.refs[index].fqn}', which does not require "
                               "grad: only trainable parameters have a main_grad")
        if self.contribution is None:
            self.contribution = self.spares.zeros(self.layout.total_numel, self.grad_dtype, self.device)
            if self._stash:  # gradients that came first (a bias before its weight's kernel) go in now, in order
                self._stash_into(self.contribution, fresh=False)
            for i in self._grad_indices:
                self.unsharded_params[i].main_grad = self._slot_view(self.contribution, i)
        return self.unsharded_params[index].main_grad

    def _drop_main_grads(self) -> None:
        for i in self._grad_indices:
            self.unsharded_params[i].__dict__.pop("main_grad", None)

    def _on_grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        if param.grad is not None:
            # megatron-core DDP's rule: a fused wgrad kernel that set grad_added_to_main_grad has
            # already added its gradient to main_grad and .grad is its dummy, unless the weight
            # is also used by a plain op (a tied embedding/output weight): then it sets
            # zero_out_wgrad, the dummy is zeros and .grad holds the other uses' gradient.
            if not getattr(param, "grad_added_to_main_grad", False) or getattr(param, "zero_out_wgrad", False):
                spec = self.refs[index].tp
                self._accumulate(index, (param.grad if spec is None else spec.local_grad(param.grad)).detach())
            param.grad = None
        param.grad_added_to_main_grad = False  # consumed; the kernel sets it again in the next backward
        self._grads_seen.add(index)
        self.used_since_sync.add(index)
        self.received_grads = True
        self.holds_grads = True
        if self._grads_seen == self._grad_indices:
            self._grads_seen.clear()
            self.grads_complete = True
            self._on_grads_ready(self)

    def _accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Take one gradient of parameter ``index`` (a buffer's slot if one is open, else the stash)."""
        self._unreduced.add(index)
        buffer = self.contribution if self.contribution is not None else self.grad_buffer
        if buffer is not None:
            self._slot_view(buffer, index).add_(grad)
        elif index in self._stash_owned:
            self._stash[index].add_(grad)
        elif index in self._stash:  # a second gradient: another backward without a reduction, or
            # a second pass of one backward (reentrant checkpointing). Summed in grad_dtype, as in a buffer.
            self._stash[index] = self._stash[index].to(self.grad_dtype, copy=True).add_(grad)
            self._stash_owned.add(index)
        else:
            # A view of a larger gradient (a slice of what torch.cat's backward made) would keep
            # all of it alive until the reduction.
            base = grad._base
            self._stash[index] = grad.clone() if base is not None and base.numel() > grad.numel() else grad

    def _fold_contribution(self) -> None:
        """Move this backward's ``main_grad`` buffer into the accumulated gradients; drop the views."""
        if self.contribution is None:
            return
        if self.grad_buffer is None:
            self.grad_buffer = self.contribution
        else:
            self.grad_buffer.add_(self.contribution)
        self.contribution = None
        self._drop_main_grads()

    def _take_grads(self, zeros_if_none: bool, scaling: GradScaling) -> torch.Tensor | None:
        """The flat buffer of every gradient not reduced yet, scaled by ``scaling`` (None if there is
        none); the group keeps none.

        Stashed gradients are written into a buffer that is not zero-filled first, scaled on the
        way in (one pass instead of a copy and a scaling pass): only what they do not cover
        (alignment padding, parameters without a gradient) is zeroed.
        """
        self._fold_contribution()
        buffer, self.grad_buffer = self.grad_buffer, None
        if self._stash and buffer is None:
            buffer = self.spares.empty(self.layout.total_numel, self.grad_dtype, self.device)
            self._stash_into(buffer, fresh=True, scaling=scaling)
            return buffer
        if self._stash:
            self._stash_into(buffer, fresh=False)
        elif buffer is None and zeros_if_none:
            buffer = self.spares.zeros(self.layout.total_numel, self.grad_dtype, self.device)
        if buffer is not None:
            scaling.apply(buffer, self.dp.size)
        return buffer

    def _stash_into(self, buffer: torch.Tensor, fresh: bool, scaling: GradScaling | None = None) -> None:
        """Add the stash into ``buffer``, or (``fresh``) write it there scaled by ``scaling``, zeroing the gaps."""
        stash, self._stash = self._stash, {}
        self._stash_owned = set()
        if not fresh:
            for index, grad in stash.items():
                self._slot_view(buffer, index).add_(grad)
            return
        end = 0
        for index in sorted(stash, key=lambda i: self.layout.slots[i].offset):
            slot = self.layout.slots[index]
            if slot.offset > end:
                buffer.narrow(0, end, slot.offset - end).zero_()
            scaling.write(self._slot_view(buffer, index), stash.pop(index), self.dp.size)  # each freed once written
            end = slot.offset + slot.numel
        if buffer.numel() > end:
            buffer.narrow(0, end, buffer.numel() - end).zero_()

    def scale_unreduced(self, factor: float) -> None:
        """Multiply the gradients not reduced yet by ``factor``."""
        for buffer in (self.grad_buffer, self.contribution):
            if buffer is not None:
                buffer.mul_(factor)
        for index, grad in self._stash.items():
            if index in self._stash_owned:
                grad.mul_(factor)
            else:  # autograd's tensor, which a hook of the user's may still reference: scale a
                # copy, widened to grad_dtype as a buffer would hold it (a bf16 product rounds)
                self._stash[index] = grad.to(self.grad_dtype) * factor
                self._stash_owned.add(index)

    def discard_unreduced_grads(self) -> None:
        """Drop gradients accumulated but not reduced yet (``zero_grad_buffer``)."""
        self.grad_buffer = None
        self.contribution = None
        self._stash = {}
        self._stash_owned = set()
        self._unreduced = set()
        self.used_since_sync = set()
        self.holds_grads = False
        self.partial_outer = None
        self._drop_main_grads()
        for index, param in enumerate(self.unsharded_params):
            param.grad_added_to_main_grad = False  # megatron-core's zero_grad_buffer resets it too
            self._sync_sharded_main_grad(index)
        self.end_backward()

    def _sync_sharded_main_grad(self, index: int) -> None:
        """Make the sharded parameter's ``main_grad`` its ``.grad`` (absent when it has none).

        Megatron-LM's optimizers and clipping read ``param.main_grad`` of the parameters they
        are given; here those are the sharded ones, whose gradient is the reduced ``.grad``.
        """
        param = self.sharded_params[index]
        if param.grad is None:
            param.__dict__.pop("main_grad", None)
        else:
            param.main_grad = param.grad

    def sync_sharded_main_grads(self) -> None:
        """Re-point every sharded ``main_grad`` at ``.grad`` (dropping it where ``.grad`` is None).

        ``optimizer.zero_grad()`` sets ``.grad`` to None but cannot know of the alias, so a
        parameter that gets no gradient in the next backward would otherwise keep last
        step's gradient as ``main_grad`` for Megatron-LM's optimizer and clipping to read.
        """
        for index in self._grad_indices:
            self._sync_sharded_main_grad(index)

    def drop_unused_fresh_grads(self, used: set[int] | None) -> None:
        """Undo the ``.grad`` the last installs created for parameters no rank had a gradient for.

        ``used``: the parameters some rank of the reduction group had a gradient for since
        the last reduction (None: unknown, keep everything). As DDP and FSDP2 leave such a
        parameter's ``.grad`` as it was, a zero one (which AdamW would decay) is not kept.
        """
        if self.partial_outer is not None:  # HSDP held back: nothing installed, the bits run on
            return
        fresh, self.fresh_grads = self.fresh_grads, set()
        self.used_since_sync = set()
        if used is None:
            return
        for i in sorted(fresh - used):
            self.sharded_params[i].grad = None
            self._sync_sharded_main_grad(i)

    def end_backward(self) -> None:
        """Reset the per-backward gradient bookkeeping; drop the post-forward shard."""
        self._fold_contribution()  # the next backward's fused kernels get a fresh main_grad buffer
        self.settle_compute_refresh()
        self.post_forward_piece = None
        self._grads_seen.clear()
        self.reduced_this_backward = False
        self.received_grads = False
        self.grads_complete = False

    @property
    def grads_pending(self) -> bool:
        """Gradients are accumulated here but not fully reduced (nor installed as ``.grad``)."""
        unreduced = self.grad_buffer is not None or self.contribution is not None or bool(self._stash)
        return (unreduced and not self.reduced_this_backward) or self.partial_outer is not None

    def reduce_grads(
        self, sync: bool, scaling: GradScaling, *, zeros_if_none: bool = False, defer_outer: bool = False
    ) -> PendingReduce | None:
        """Start reducing the accumulated gradients (unless ``sync`` is off).

        ``zeros_if_none``: with nothing accumulated here, reduce zeros (this rank
        still takes part in a reduction other ranks issue). ``defer_outer`` (HSDP, a
        non-last micro-batch): reduce inside dp_shard only and add the result to the
        partial sum held for dp_outer; the first reduction without it reduces the sum
        across dp_outer once (all-reduce, or reduce-scatter under outer 'optim').
        """
        if not sync:
            return None
        buffer = self._take_grads(zeros_if_none, scaling)
        if buffer is None:
            return None
        self.holds_grads = False
        self._drop_main_grads()
        self._reducing |= self._unreduced | self._grad_indices
        self._unreduced = set()
        self.reduced_this_backward = True
        if self.comm_dtype != buffer.dtype:
            buffer = buffer.to(self.comm_dtype)
        if self.dp.shard_size == 1:
            reduce = PendingReduce(self, Pending(None), buffer)
        elif self.plan.grads:
            # dp_shard's share of the gradients: the main shard, or under outer 'optim' the compute shard.
            numel = self.layout.shard_numel * (self.outer.outer_size if self.outer is not None else 1)
            output = torch.empty(numel, dtype=buffer.dtype, device=buffer.device)
            work = reduce_scatter(output, buffer, self.reduce_process_group, input_is_scratch=True, comm=self.comm)
            # No gradient aliases the buffer; a cast copy (comm dtype) is not worth keeping.
            reduce = PendingReduce(self, work, output, scratch=buffer if buffer.dtype == self.grad_dtype else None)
        else:
            work = all_reduce(buffer, self.reduce_process_group, comm=self.comm, stream=REDUCE_STREAM)
            n = self.layout.shard_numel
            reduce = PendingReduce(self, work, buffer.narrow(0, self.shard_rank * n, n))
        # Chained on the outer stream unless a partial sum must first be added on the host's
        # stream (outer 'optim', or a partial in another dtype): that add runs once the inner
        # reduction landed, unchained. An all-reduce adds a same-dtype partial on its stream.
        reduce.defer_outer = defer_outer
        partial = self.partial_outer
        if (self.comm.stream_provider(buffer.device) is not None and self._outer_stage_issues(defer_outer)
                and (partial is None or (self.outer is None and partial.dtype == buffer.dtype))):
            reduce.chain_outer()
        return reduce

    @property
    def _has_outer(self) -> bool:
        """HSDP: there is a dp_outer dimension of more than one rank."""
        return self.outer is not None or (self.dp.has_outer and self.dp.outer_size > 1)

    def _holds_outer(self, defer: bool) -> bool:
        """The outer stage of a reduction started with ``defer`` is held back (summed into ``partial_outer``)."""
        return self._has_outer and (defer or (self.outer is None and not self.requires_all_reduce))

    def _outer_stage_issues(self, defer: bool) -> bool:
        """Reducing gradients issues a collective across dp_outer (HSDP, not held back)."""
        return self._has_outer and not self._holds_outer(defer)

    def _hold_outer(self, reduced_shard: torch.Tensor) -> None:
        """Add a dp_shard-reduced part into the partial sum kept for dp_outer (in ``grad_dtype``)."""
        if self.partial_outer is None:
            self.partial_outer = reduced_shard.to(self.grad_dtype)
        else:
            self.partial_outer.add_(reduced_shard)

    def start_outer_reduction(
        self, reduced_shard: torch.Tensor, after: Pending | None = None, defer: bool = False
    ) -> tuple[Pending, torch.Tensor | None]:
        """HSDP: start summing the dp_shard-reduced gradients over dp_outer.

        Returns the work and where this rank's main-shard part lands: outer 'optim'
        reduce-scatters into this rank's piece; a replicating outer dimension
        all-reduces in place; without an outer dimension nothing is issued.
        ``after``: the inner reduction producing ``reduced_shard``, still in flight (on
        side streams only: the outer stream waits on its events; see ``PendingReduce.chained``).
        ``defer``: hold the outer stage (returns None for the result: nothing to install).
        """
        if not self._has_outer:
            return Pending(), reduced_shard
        if self._holds_outer(defer):  # never chained: the inner reduction has landed
            self._hold_outer(reduced_shard)
            return Pending(), None
        partial, self.partial_outer = self.partial_outer, None
        if partial is not None and partial.dtype != reduced_shard.dtype:
            # Summed in grad_dtype, cast once to the communication dtype (never chained: landed).
            reduced_shard.copy_(partial.add_(reduced_shard))
            partial = None
        if self.outer is not None:
            if partial is not None:  # never chained (reduce_grads): the inner reduction has landed
                reduced_shard = partial.add_(reduced_shard)
            piece = torch.empty(self.layout.shard_numel, dtype=reduced_shard.dtype, device=reduced_shard.device)
            return (
                reduce_scatter(piece, reduced_shard, self.dp.outer_group, kind="reduce_scatter_outer", comm=self.comm,
                               stream=OUTER_STREAM, after=after),
                piece,
            )
        return all_reduce(reduced_shard, self.dp.outer_group, comm=self.comm, stream=OUTER_STREAM, after=after,
                          accumulate=partial), reduced_shard

    def install_grads(self, reduced_shard: torch.Tensor) -> None:
        """Add the reduced shard into the sharded parameters' ``.grad`` (creating them).

        Under CPU offload the shard is first copied to the host, where the gradients live.
        """
        if self.offload is not None:
            reduced_shard = download(reduced_shard, self.dtype, self.offload)
            self.downloads += 1
        installing, self._reducing = self._reducing | self._grad_indices, set()
        for i in sorted(installing):
            param = self.sharded_params[i]
            local = self.params[i].shard_view(reduced_shard).to(self.dtype)
            if param.grad is None:
                param.grad = self.params[i].as_dtensor(local)
                self.fresh_grads.add(i)
            else:
                param.grad.to_local().add_(local)
            self._sync_sharded_main_grad(i)
            # As FSDP2 does: the sharded parameter's .grad is set by us, not by autograd's
            # AccumulateGrad, so its post-accumulate hooks (optimizer in backward) run here.
            for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(param)

"""FSDPModule: the methods a ``fully_shard``-ed module gains.

``fully_shard`` swaps the module's class for a dynamic subclass of
``(FSDPModule, original class)``, as FSDP2 does; the module keeps its
attributes, FQNs and ``state_dict`` keys. All runtime state lives in the
``FSDPUnit`` at ``module.fsdp_unit``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from megatron_fsdp.comm.collectives import CommStats
from megatron_fsdp.core.grad_scaling import resolve_grad_scaling
from megatron_fsdp.core.lookup import UNIT_ATTR, units_of
from megatron_fsdp.core.meta_init import META_BUFFERS
from megatron_fsdp.core.options import EngineOptions
from megatron_fsdp.core.unit import FSDPUnit
from megatron_fsdp.core.validation import check_bool, check_reshard_after_forward


class FSDPModule:
    """Mixin for modules sharded by :func:`megatron_fsdp.fully_shard`."""

    @property
    def fsdp_unit(self) -> FSDPUnit:
        return self.__dict__[UNIT_ATTR]

    def _fsdp_units(self, recurse: bool) -> Iterator[FSDPUnit]:
        if not recurse:
            yield self.fsdp_unit
            return
        yield from units_of(self)  # type: ignore[arg-type]

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """``nn.Module._apply`` (``to_empty``, ``to`` ...) on the sharded parameters, kept in our shards.

        Resharded first, as FSDP2 does, so that it sees the sharded parameters. ``fn``
        runs on each sharded parameter's (and gradient's) local piece, re-wrapped in our
        placement: stock DTensor ops would lay a ``RaggedShard`` out by even chunks. Then
        each group takes the new values into its flat shard (``ParamGroup.applied``).
        Children that are units do the same in their own ``_apply``.
        """
        self.reshard()
        params, grads = {}, {}
        for group in self.fsdp_unit.groups:
            for index, param in enumerate(group.sharded_params):
                params[id(param)] = (group, index)
                if param.grad is not None:
                    grads[id(param.grad)] = (group, index)

        def on_local_pieces(tensor):  # noqa: ANN001, ANN202
            if id(tensor) in params:
                group, index = params[id(tensor)]
                return group.applied(index, tensor, fn(tensor.to_local()))
            if id(tensor) in grads:
                group, index = grads[id(tensor)]
                return group.as_dtensor(index, fn(tensor.to_local()))
            return fn(tensor)

        result = super()._apply(on_local_pieces, recurse)  # type: ignore[misc]
        # Buffers built on meta were replaced too (to_empty): whoever called this initialises
        # them (reset_parameters after to_empty, FSDP2's idiom), as ``applied`` says for the
        # parameters; materialize_meta must not re-initialise them over the caller's values.
        for module in self.modules():
            module.__dict__.pop(META_BUFFERS, None)
        return result

    @property
    def fsdp_options(self) -> EngineOptions:
        """The engine options this unit runs with: its root's (``fully_shard(..., options=...)``)."""
        return self.fsdp_unit.options

    @property
    def fsdp_comm_stats(self) -> CommStats:
        """Bytes and calls of the collectives of this unit's root (every unit under it shares one).

        The process-wide ``megatron_fsdp.comm_stats`` counts them too, with every other
        model's; this one counts only this root's engine collectives (gathers,
        reductions, control rounds, initial broadcasts; not ``clip_grad_norm_``'s).
        """
        return self.fsdp_unit.comm.stats

    def unshard(self) -> None:
        """All-gather this unit's parameters and install the unsharded views."""
        self.fsdp_unit.unshard()

    def reshard(self) -> None:
        """Free this unit's unsharded parameters; modules hold the sharded ones again.

        Also the way to make the next forward re-gather after the sharded
        parameters were changed outside an optimizer step (e.g. a load).
        """
        self.fsdp_unit.mark_weights_stale()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in backward (True) or accumulate them locally (False).

        Gradients accumulated with False must be reduced before the optimizer
        steps (a backward with True, or ``MegatronFSDP.finish_grad_sync()``);
        an optimizer step on parameters whose gradients are still unreduced raises.
        """
        flag = check_bool("requires_gradient_sync", requires_gradient_sync, where="set_requires_gradient_sync")
        for unit in self._fsdp_units(recurse):
            unit.requires_gradient_sync = flag

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free (ZeRO-3) weights after forward, or keep them for backward."""
        flag = check_reshard_after_forward(reshard_after_forward, where="set_reshard_after_forward")
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_forward = flag

    def set_prefetch_depth(self, depth: int, *, recurse: bool = True) -> None:
        """How many units ahead (in the recorded forward order) to all-gather early; 0 disables."""
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"set_prefetch_depth: depth must be a non-negative int, got {depth!r}")
        for unit in self._fsdp_units(recurse):
            unit.prefetch_depth = depth

    def set_gradient_scaling(self, gradient_scaling: str | float, *, recurse: bool = True) -> None:
        """Normalise reduced gradients by ``"mean"``, ``"sum"`` or a positive factor."""
        scaling = resolve_grad_scaling(gradient_scaling)
        for unit in self._fsdp_units(recurse):
            unit.grad_scaling = scaling

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them inside the block.

        Run the step's last backward outside it (or call
        ``MegatronFSDP.finish_grad_sync()``) before the optimizer steps.
        """
        previous = [(u, u.requires_gradient_sync) for u in self._fsdp_units(True)]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit, value in previous:
                unit.requires_gradient_sync = value


_SUBCLASSES: dict[type, type] = {}


def make_fsdp_module(module: nn.Module, unit: FSDPUnit) -> nn.Module:
    """Swap ``module``'s class to the FSDP subclass and attach ``unit``."""
    cls = type(module)
    subclass = _SUBCLASSES.get(cls)
    if subclass is None:
        subclass = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
        _SUBCLASSES[cls] = subclass
    module.__class__ = subclass
    module.__dict__[UNIT_ATTR] = unit
    return module

"""FSDPModule: the methods a ``fully_shard``-ed module gains.

``fully_shard`` swaps the module's class for a dynamic subclass of
``(FSDPModule, torch.distributed.fsdp.FSDPModule, original class)``, as FSDP2
does; the module keeps its attributes, FQNs and ``state_dict`` keys. All runtime
state lives in the ``FSDPUnit`` at ``module.fsdp_unit``.

Every sharded module is an instance of PyTorch's FSDP2 ``FSDPModule`` too, so
code that looks for FSDP2 modules (``isinstance(m, FSDPModule)``: torchtitan,
Lightning, Accelerate, torch's own helpers) finds ours and calls the methods
below, which keep FSDP2's names and meanings. Torch's class joins at
``fully_shard`` time, not as a base of ``FSDPModule`` itself, so that
``import megatron_fsdp`` does not import ``torch.distributed.fsdp``
(``fsdp2_classes.py``); ``UnshardHandle`` likewise. FSDP2 methods that need FSDP2's
own runtime state (``set_custom_all_gather``, ``set_post_optim_event``, ...)
are not overridden: they reach ``_get_fsdp_state``, which raises naming the method.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from megatron_fsdp.comm.collectives import CommStats
from megatron_fsdp.core.fsdp2_classes import fsdp2_class
from megatron_fsdp.core.grad_scaling import GradScaling, resolve_grad_scaling
from megatron_fsdp.core.lookup import UNIT_ATTR, units_of
from megatron_fsdp.core.meta_init import META_BUFFERS
from megatron_fsdp.core.options import EngineOptions
from megatron_fsdp.core.unit import FSDPUnit
from megatron_fsdp.core.validation import check_bool, check_reshard_after_forward


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` installs the gathered parameters.

    Waiting is optional: the module's next forward waits for the gather and uses it
    without gathering again. The handles returned are also FSDP2 ``UnshardHandle``s
    (``_handle_class``).
    """

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit: FSDPUnit | None = unit

    def wait(self) -> None:
        """Wait for the all-gather; the module then holds its unsharded parameters."""
        if self._unit is not None:
            unit, self._unit = self._unit, None
            unit.wait_explicit_unshard()


def _prefetch_units(modules: Any, where: str) -> list[FSDPUnit]:
    if isinstance(modules, nn.Module) or not hasattr(modules, "__iter__"):
        raise TypeError(f"{where}: modules must be a list of fully_shard-ed modules, got {type(modules).__name__}")
    units = []
    for module in modules:
        unit = module.__dict__.get(UNIT_ATTR) if isinstance(module, nn.Module) else None
        if unit is None:
            raise ValueError(
                f"{where}: expects modules sharded by megatron_fsdp.fully_shard, got {type(module).__name__}"
            )
        units.append(unit)
    return units


@functools.cache
def _handle_class() -> type[UnshardHandle]:
    """``UnshardHandle`` with FSDP2's ``UnshardHandle`` as a second base (torch's FSDP package is imported by
    then: ``fully_shard`` imported it)."""
    torch_handle = fsdp2_class("UnshardHandle")
    if torch_handle is None:  # pragma: no cover - a torch without FSDP2
        return UnshardHandle
    return type("UnshardHandle", (UnshardHandle, torch_handle), {"__module__": __name__})


class FSDPModule:
    """Mixin for modules sharded by :func:`megatron_fsdp.fully_shard` (an FSDP2 ``FSDPModule`` too)."""

    # In FSDP<Orig>'s MRO the original class follows ours and torch's:
    # [FSDP<Orig>, FSDPModule, torch FSDPModule, Orig, ...] (read by torch 2.13's __new__).
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        """Constructing the FSDP subclass (a container slicing itself) builds the original class, as FSDP2 does.

        Written here rather than inherited: older torch versions' ``__new__`` take the
        original class at a fixed MRO index that is torch's own ``FSDPModule`` for us.
        """
        torch_module = fsdp2_class("FSDPModule") or FSDPModule
        original = next(c for c in cls.__mro__ if not issubclass(c, (FSDPModule, torch_module)))
        module = original.__new__(original, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """Refused, as FSDP2 does: a copy would share this module's runtime (its unit, hooks and shards)."""
        raise TypeError(
            f"copy.deepcopy of a fully_shard-ed {type(self).__bases__[-1].__name__} is not supported (as with FSDP2): "
            "copy the model before fully_shard, or move its values with state dicts"
        )

    def _get_fsdp_state(self):  # noqa: ANN202 - torch's private hook
        """FSDP2's runtime state, which these modules do not have: name the FSDP2 method that needed it."""
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_name.startswith("<"):  # <listcomp>, <genexpr>
            frame = frame.f_back
        caller = frame.f_code.co_name
        where = f"{type(self).__bases__[-1].__name__}.{caller}()" if "self" in frame.f_locals else f"{caller}()"
        raise NotImplementedError(
            f"{where}: this FSDP2 API relies on torch's own fully_shard runtime, which megatron_fsdp "
            "modules do not use; see docs/fsdp2.md for the FSDP2 methods supported"
        )

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for reducing zero gradients of parameters unused on some ranks.

        Ours always does (a parameter without a gradient on a rank contributes zeros to the
        one reduce-scatter of its group), so ``True`` is accepted as is; ``False`` is refused.
        """
        if not reduce_scatter_unused_params:
            raise NotImplementedError(
                "set_reduce_scatter_unused_params(False): megatron_fsdp always reduces every parameter's "
                "gradient (zeros where a rank did not use it), which FSDP2 does with True; remove the call"
            )

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
                return group.params[index].as_dtensor(fn(tensor.to_local()))
            return fn(tensor)

        # past torch's FSDPModule._apply (FSDP2's own resharding) to the original class's
        result = super(fsdp2_class("FSDPModule") or FSDPModule, self)._apply(on_local_pieces, recurse)
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

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters and install the unsharded views (not recursive).

        ``async_op=True`` returns an :class:`UnshardHandle` at once, so the gather
        overlaps the caller's work; ``wait()`` installs the parameters, and the next
        forward uses them without gathering again (it waits itself if nobody did).
        Like any collective, every data-parallel rank calls it for the same modules in
        the same order. Inside the root's forward or backward, the gather is issued in
        the schedule's agreed order (docs/design.md section 5a).
        """
        async_op = check_bool("async_op", async_op, where="unshard")
        unit = self.fsdp_unit
        unit.start_explicit_unshard()
        handle = _handle_class()(unit)
        if async_op:
            return handle
        handle.wait()
        return None

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

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce gradients across the replicate (outer) dimension (True) or defer it (False).

        With False each backward still reduce-scatters inside the shard dimension,
        and the partial results are summed here; the first backward with True adds
        them in and all-reduces once, so ``.grad`` is then exactly what syncing every
        backward would give. An optimizer step while partials are held raises.
        """
        flag = check_bool("requires_all_reduce", requires_all_reduce, where="set_requires_all_reduce")
        for unit in self._fsdp_units(recurse):
            for group in unit.groups:
                if group.outer is not None:
                    raise ValueError(
                        "set_requires_all_reduce: the outer dimension of this model shards the optimizer "
                        "(outer_sharding_strategy='optim'), so its gradients are reduce-scattered, not all-reduced; "
                        "use set_requires_gradient_sync(False) to defer both levels"
                    )
            for group in unit.groups:
                group.requires_all_reduce = flag

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last one before an optimizer step (FSDP2's microbatching hint).

        With False the end of backward does not prepare for an optimizer step:
        gathered weights and low-precision compute copies are kept for the next
        micro-batch (ZeRO-1/2, and ZeRO-3 units with ``set_reshard_after_backward(False)``).
        Gradients are still reduced when gradient sync is on. It applies to the
        whole root, as in FSDP2; set it back to True before the step's last backward.
        """
        flag = check_bool("is_last_backward", is_last_backward, where="set_is_last_backward")
        unit = self.fsdp_unit
        root = unit.root_state.root if unit.root_state is not None else unit
        root.is_last_backward = flag

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free (ZeRO-3) weights after this unit's backward (True), or keep them for the next forward.

        False trades memory for communication during gradient accumulation: the next
        forward uses the kept weights without gathering them. Weights are kept only
        where every rank can keep them (agreed at the end of backward), and never past
        a backward after which an optimizer step may follow (gradient sync on and
        ``set_is_last_backward(True)``): the step would make them stale.
        """
        flag = check_bool("reshard_after_backward", reshard_after_backward, where="set_reshard_after_backward")
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_backward = flag

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' weights early, when this module's forward starts.

        As in FSDP2 this replaces the default for this module (``set_prefetch_depth``):
        the gathers issued are those of the agreed sequence up to the furthest listed
        module, in that order, so lists may differ across ranks without mispairing
        collectives. ``[]`` prefetches nothing; ``None`` restores the depth.
        """
        self.fsdp_unit.forward_prefetch = (
            None if modules is None else _prefetch_units(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' weights early, when this module's backward starts (see the forward one)."""
        self.fsdp_unit.backward_prefetch = (
            None if modules is None else _prefetch_units(modules, "set_modules_to_backward_prefetch"))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size (not recursive, as FSDP2).

        The same feature as ``set_gradient_scaling(1 / factor)``: local gradients are
        multiplied by ``1 / factor`` and then summed.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        self.fsdp_unit.grad_scaling = GradScaling("factor", 1.0 / float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: megatron_fsdp's gradient collectives are always SUM.

        Gradients are scaled before the collective (docs/design.md section 6), never
        reduced with ``AVG`` or a pre-multiplied sum, whatever ``enable`` says.
        """
        check_bool("enable", enable, where="set_force_sum_reduction_for_comms")

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


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module``'s pre- and post-forward hooks (gather, reshard) around ``module.<method_name>``.

    FSDP2's function of the same name: for methods other than ``forward`` that use
    the module's parameters (``generate``, ``forward_features``). A module not sharded
    by ``fully_shard`` is left alone, so code can call it either way. A forward run
    inside the method (``generate`` calling ``self(...)``) is part of it: the weights
    stay gathered until the method returns.
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__bases__[-1].__name__} has no method "
                         f"{method_name!r}")
    original = getattr(module, method_name)
    unit = module.fsdp_unit

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit.pre_forward(module, args, kwargs)
        output = None
        try:
            output = original(*args, **kwargs)
        finally:
            output = unit.post_forward(module, args, output)
        return output

    setattr(module, method_name, wrapped)


_SUBCLASSES: dict[type, type] = {}


def make_fsdp_module(module: nn.Module, unit: FSDPUnit) -> nn.Module:
    """Swap ``module``'s class to the FSDP subclass and attach ``unit``."""
    cls = type(module)
    subclass = _SUBCLASSES.get(cls)
    if subclass is None:
        torch_module = fsdp2_class("FSDPModule")  # FSDP2's, for isinstance checks written for FSDP2
        bases = (FSDPModule, cls) if torch_module is None else (FSDPModule, torch_module, cls)
        subclass = type(f"FSDP{cls.__name__}", bases, {"__module__": cls.__module__})
        _SUBCLASSES[cls] = subclass
    module.__class__ = subclass
    module.__dict__[UNIT_ATTR] = unit
    return module

"""``fully_shard`` inside ``fully_shard_context``, and ``microbatch(context, is_last)``: the placements API.

Megatron-LM main's ``megatron_fsdp.experimental`` API, over this library's one engine. Each
``fully_shard(module, mesh, placements)`` call validates the placements (``placements.py``), maps
them to a ``sharding_strategy`` and HSDP ``outer_sharding_strategy``, and shards the module with the
engine's per-module ``fully_shard`` at once (bottom-up, as FSDP2 and Megatron-LM v2). The module
also becomes an ``FsdpModule`` of this API: it knows its ``FsdpContext``, its name and whether it is
a root, all fixed when the ``with fully_shard_context()`` block exits (docs/api.md, "The placements
API"). What the engine does in forward and backward is the engine's: gathers, reductions,
prefetch, accumulation; the context records the roots and the prefetch orders that Megatron-LM's
implementation drives its own prefetch by, and ``microbatch`` tells the engine's accumulation
(``megatron_fsdp.microbatch``) which micro-batch is the last one.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed import DeviceMesh

from megatron_fsdp.core.lookup import unit_of, units_of
from megatron_fsdp.core.microbatch import microbatch as engine_microbatch
from megatron_fsdp.core.unit import FSDPUnit, TrainingState
from megatron_fsdp.experimental.annotation import add_nvtx_ranges
from megatron_fsdp.experimental.mixed_precision import SUPPORTED_DTYPES, MixedPrecisionPolicy
from megatron_fsdp.experimental.placements import Placements, map_placements
from megatron_fsdp.fully_shard import fully_shard as engine_fully_shard

__all__ = [
    "FsdpContext",
    "FsdpModule",
    "FsdpParameter",
    "ParameterGroup",
    "containing_parameter_group",
    "fully_shard",
    "fully_shard_context",
    "microbatch",
]

_CONTEXT: ContextVar[FsdpContext | None] = ContextVar("megatron_fsdp_experimental_context", default=None)
_STATE_ATTR = "_megatron_fsdp_experimental"  # module.__dict__ key of an FsdpModule's _ModuleState
_GROUP_ATTR = "_megatron_fsdp_experimental_group"  # a sharded parameter's weakref to its ParameterGroup


class FsdpContext:
    """The modules sharded in one ``with fully_shard_context()`` block: roots, names, orders, micro-batch state.

    Attributes:
        device: the device its modules compute on.
        use_symmetric_memory, unify_communication_stream: as passed to ``fully_shard_context``.
        is_last_microbatch: what the innermost ``microbatch`` said (True outside one).
        forward_order, backward_order: every ``FsdpModule`` of the context in forward (pre-order,
            roots in construction order) and backward (reverse-children pre-order, roots reversed)
            order, fixed on exit.
    """

    def __init__(self, device: torch.device, use_symmetric_memory: bool = False,
                 unify_communication_stream: bool = False) -> None:
        """An empty context for modules on ``device`` (``fully_shard_context`` makes one)."""
        self.device = device
        self.use_symmetric_memory = use_symmetric_memory
        self.unify_communication_stream = unify_communication_stream
        self.is_last_microbatch = True
        self.forward_order: list[FsdpModule] = []
        self.backward_order: list[FsdpModule] = []
        self._registered: list[FsdpModule] = []
        self._roots: list[FsdpModule] = []
        self._finalized = False
        self._next_is_first = True  # the next micro-batch starts a step (the last one ended one)

    @property
    def roots(self) -> tuple[FsdpModule, ...]:
        """The context's outermost modules, in the order ``fully_shard`` was applied to them."""
        return tuple(self._roots)

    @property
    def is_finalized(self) -> bool:
        """Whether the ``with fully_shard_context()`` block has exited."""
        return self._finalized

    def register_module(self, module: FsdpModule) -> None:
        """Add a module sharded in this context (``fully_shard`` calls it)."""
        if self._finalized:
            raise RuntimeError("Cannot register an FSDP module after its context is finalized.")
        self._registered.append(module)

    def finalize(self) -> None:
        """Fix roots, names and the forward and backward orders (on leaving the ``with`` block)."""
        if self._finalized:
            raise RuntimeError("FSDP context is already finalized.")
        children: set[int] = set()
        for module in self._registered:
            _nearest_fsdp_descendants(cast(nn.Module, module), children)
        self._roots = [m for m in self._registered if id(m) not in children]
        for root in self._roots:
            _state(root).is_root = True
            for name, module in cast(nn.Module, root).named_modules():
                if isinstance(module, FsdpModule):
                    _state(module).name = name
                    self.forward_order.append(module)
        for root in reversed(self._roots):
            _backward_order(cast(nn.Module, root), self.backward_order)
        self._registered.clear()
        self._finalized = True

    def ensure_finalized(self) -> None:
        """RuntimeError while the ``with fully_shard_context()`` block is still open."""
        if not self._finalized:
            raise RuntimeError("FSDP context is not finalized. Exit fully_shard_context before running forward.")


@dataclass
class _ModuleState:
    context: FsdpContext
    placements: Placements
    groups: tuple[ParameterGroup, ...] = ()
    name: str | None = None
    is_root: bool = False


@dataclass(frozen=True, eq=False)
class FsdpParameter:
    """One physical parameter: every name it is registered under (tied weights: several), and its sharded form."""

    fqns: tuple[str, ...]
    sharded: nn.Parameter


class ParameterGroup:
    """The parameters of one ``FsdpModule`` that share a dtype and ``requires_grad`` (Megatron-LM v2's grouping).

    A view over the engine's flat-buffer groups of that kind (the engine may split one kind into
    several buffers, docs/design.md).
    """

    def __init__(self, unit: FSDPUnit, groups: list[Any], dtype: torch.dtype, requires_grad: bool) -> None:
        """The view of ``groups`` (engine groups of ``unit``) whose parameters are of ``dtype``."""
        self._unit = weakref.ref(unit)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.fsdp_parameters = tuple(
            FsdpParameter(tuple(ref.fqns), sharded)
            for group in groups for ref, sharded in zip(group.refs, group.sharded_params)
        )
        for parameter in self.fsdp_parameters:
            setattr(parameter.sharded, _GROUP_ATTR, weakref.ref(self))

    @property
    def main_grad(self) -> tuple[torch.Tensor | None, ...] | None:
        """The group's sharded gradients in ``fsdp_parameters`` order (None entries before a backward),
        or None for a group without trainable parameters (no gradient storage is kept for it)."""
        if not self.requires_grad:
            return None
        return tuple(parameter.sharded.grad for parameter in self.fsdp_parameters)

    def sync_model_weight_from_main_weight(self) -> None:
        """Make the next forward use the main weights as they are now (after writing them directly)."""
        unit = self._unit()
        if unit is not None:
            unit.mark_weights_stale()


def containing_parameter_group(parameter: torch.Tensor) -> ParameterGroup | None:
    """The ``ParameterGroup`` of a parameter sharded by the placements API, or None."""
    ref = getattr(parameter, _GROUP_ATTR, None)
    return ref() if ref is not None else None


class FsdpModule:
    """What a module sharded by the placements API adds to its class (``isinstance(m, FsdpModule)``)."""

    class Phase(enum.Enum):
        """Where a module is: between passes, in its forward, or in its backward."""

        RESTING = enum.auto()
        FORWARD = enum.auto()
        BACKWARD = enum.auto()

    @property
    def context(self) -> FsdpContext:
        """The ``FsdpContext`` this module was sharded in."""
        return _state(self).context

    @property
    def name(self) -> str:
        """Its name relative to its root (``""`` for a root); RuntimeError before the context exits."""
        name = _state(self).name
        if name is None:
            raise RuntimeError("FSDP module name has not been initialized.")
        return name

    def is_root(self) -> bool:
        """Whether no other module of its context encloses it (known once the context exits)."""
        return _state(self).is_root

    @property
    def phase(self) -> FsdpModule.Phase:
        """``Phase.FORWARD`` inside its forward, ``Phase.BACKWARD`` inside its backward, else ``RESTING``."""
        state = cast(FSDPUnit, unit_of(cast(nn.Module, self))).state
        if state is TrainingState.FORWARD:
            return FsdpModule.Phase.FORWARD
        if state is TrainingState.BACKWARD:
            return FsdpModule.Phase.BACKWARD
        return FsdpModule.Phase.RESTING

    @property
    def parameter_groups(self) -> tuple[ParameterGroup, ...]:
        """Its own parameters (not those of ``FsdpModule`` children) by dtype and ``requires_grad``."""
        return _state(self).groups


def _parameter_groups(unit: FSDPUnit) -> tuple[ParameterGroup, ...]:
    kinds: dict[tuple[torch.dtype, bool], list[Any]] = {}
    for group in unit.groups:
        kinds.setdefault((group.refs[0].param.dtype, group.requires_grad), []).append(group)
    return tuple(ParameterGroup(unit, groups, dtype, grad) for (dtype, grad), groups in kinds.items())


_CLASSES: dict[type, type] = {}


def _state(module: object) -> _ModuleState:
    return cast(nn.Module, module).__dict__[_STATE_ATTR]


def _nearest_fsdp_descendants(module: nn.Module, out: set[int]) -> None:
    for child in module.children():
        if isinstance(child, FsdpModule):
            out.add(id(child))
        else:
            _nearest_fsdp_descendants(child, out)


def _backward_order(module: nn.Module, order: list[FsdpModule]) -> None:
    if isinstance(module, FsdpModule):
        order.append(module)
    for child in reversed(list(module.children())):
        _backward_order(child, order)


def _owned_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters ``fully_shard(module)`` takes: its subtree's, less those of ``FsdpModule`` children."""
    owned: dict[str, nn.Parameter] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, param in mod.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{prefix}{name}"
            if getattr(param, "_megatron_fsdp_sharded", False) or getattr(param, "_megatron_fsdp_managed", False):
                raise ValueError(f"Parameter {fqn!r} is already owned by another FsdpModule.")
            owned[fqn] = param
        for name, child in mod.named_children():
            if unit_of(child) is None:
                visit(child, f"{prefix}{name}.")

    visit(module, "")
    return owned


def _engine_policy(owned: dict[str, nn.Parameter], policy: MixedPrecisionPolicy) -> Any:
    dtypes = {param.dtype for param in owned.values()}
    for dtype in dtypes:
        if dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(f"Unsupported dtype: {dtype}.")
    if policy.main_grads_dtype is None and len(dtypes) > 1:
        raise NotImplementedError(
            f"fully_shard: the module's own parameters have several dtypes {sorted(map(str, dtypes))} and "
            "main_grads_dtype=None (each parameter's dtype); give MixedPrecisionPolicy(main_grads_dtype=...) "
            "or fully_shard the parts of one dtype separately"
        )
    return policy.engine_policy(next(iter(dtypes)) if dtypes else torch.float32)


def _refuse_assign_load(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_: Any) -> None:
    # torch hands load_state_dict(assign=True) to pre-hooks through this metadata key.
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            "load_state_dict(assign=True) is not supported after fully_shard(). "
            "Load before fully_shard() or use an in-place load path with assign=False."
        )


def _check_context_ready(module: nn.Module, args: tuple) -> None:
    _state(module).context.ensure_finalized()


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    grad_divisor: int = 1,
) -> None:
    """Shard ``module`` in place as ``placements`` say, inside a ``with fully_shard_context()`` block.

    Apply it bottom-up (blocks first, then their parents); a module's own parameters are those not
    already owned by a sharded descendant. Its class becomes a subclass that is also an
    ``FsdpModule``; parent modules keep their references to it.

    Args:
        module: the module to shard.
        mesh: the data-parallel ``DeviceMesh``: 1-D, or 2-D ``(outer, inner)`` for HSDP/HFSDP.
        placements: ``Placements`` for every axis of ``mesh`` (``PRESETS`` lists the usual ones).
        mixed_precision_policy: main-weight, main-gradient and reduction dtypes (default:
            ``MixedPrecisionPolicy()``: fp32 main weights, gradients in the parameter dtype).
        grad_divisor: a further divisor of the averaged gradients (expert parallelism: the
            expert-parallel size, since each rank's expert gradient already sums that many ranks' tokens).

    Raises:
        ValueError: an ``FsdpModule`` (or a module the engine's ``fully_shard`` already sharded); a
            child ``FsdpModule`` of another context, or a child the engine's other entry points sharded;
            a parameter another ``FsdpModule`` owns;
            ``grad_divisor`` not positive; malformed axes or placements.
        RuntimeError: called outside ``fully_shard_context``.
        TypeError, NotImplementedError: see ``placements.map_placements``; a parameter dtype other
            than fp32, bf16 and fp16.
    """
    if isinstance(module, FsdpModule) or unit_of(module) is not None:
        raise ValueError("This module is already managed by FSDP.")
    context = _CONTEXT.get()
    if context is None:
        raise RuntimeError("fully_shard must run inside fully_shard_context.")
    for sub in module.modules():
        if isinstance(sub, FsdpModule) and sub.context is not context:
            raise ValueError("Cannot fully_shard a module containing an FSDP child from another fully_shard_context.")
        if unit_of(sub) is not None and not isinstance(sub, FsdpModule):
            raise ValueError(
                f"Cannot fully_shard a module containing a child ({type(sub).__name__}) sharded by "
                "megatron_fsdp.fully_shard or fully_shard_model; a model uses one of the entry points."
            )
    mapping = map_placements(placements, mesh)
    if isinstance(grad_divisor, bool) or not isinstance(grad_divisor, (int, float)) or grad_divisor <= 0:
        raise ValueError(f"grad_divisor must be positive, got {grad_divisor}.")
    policy = mixed_precision_policy if mixed_precision_policy is not None else MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            "mixed_precision_policy must be a megatron_fsdp.experimental.MixedPrecisionPolicy, "
            f"got {type(policy).__name__}"
        )
    owned = _owned_parameters(module)
    engine_policy = _engine_policy(owned, policy)
    # "mean" averages over every data-parallel rank; a divisor scales each rank's part before the sum.
    scaling: str | float = "mean" if grad_divisor == 1 else 1.0 / (mesh.size() * grad_divisor)
    engine_fully_shard(module, mesh=mesh, sharding_strategy=mapping.sharding_strategy,
                       outer_sharding_strategy=mapping.outer_sharding_strategy, gradient_scaling=scaling,
                       mp_policy=engine_policy)
    engine_class = type(module)
    cls = _CLASSES.get(engine_class)
    if cls is None:
        cls = type(engine_class.__name__, (engine_class, FsdpModule), {"__module__": engine_class.__module__})
        _CLASSES[engine_class] = cls
    module.__class__ = cls
    module.__dict__[_STATE_ATTR] = _ModuleState(context, placements, _parameter_groups(cast(FSDPUnit, unit_of(module))))
    add_nvtx_ranges(module)
    module.register_forward_pre_hook(_check_context_ready, prepend=True)  # first of all
    handle = module.register_load_state_dict_pre_hook(_refuse_assign_load)
    module._load_state_dict_pre_hooks.move_to_end(handle.id, last=False)  # before the engine's own
    context.register_module(cast(FsdpModule, module))


@contextlib.contextmanager
def fully_shard_context(
    device: torch.device | None = None,
    *,
    use_symmetric_memory: bool = False,
    unify_communication_stream: bool = False,
) -> Iterator[FsdpContext]:
    """The block in which ``fully_shard`` is applied; on exit, roots, names and orders are fixed.

    Args:
        device: the device the modules compute on (default: the current CUDA device where CUDA is
            available, else the CPU).
        use_symmetric_memory: accepted for Megatron-LM's signature; the engine's buffers do not come
            from NCCL's symmetric-memory pool, so on CUDA it changes nothing (docs/api.md); on
            another device it raises ValueError.
        unify_communication_stream: accepted for Megatron-LM's signature; a no-op (docs/api.md).

    Raises:
        RuntimeError: a context opened inside another.
    """
    if _CONTEXT.get() is not None:
        raise RuntimeError("fully_shard_context does not support nesting.")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if use_symmetric_memory and device.type != "cuda":
        raise ValueError(f"use_symmetric_memory=True needs a CUDA device (NCCL symmetric memory), got {device}.")
    context = FsdpContext(device, use_symmetric_memory, unify_communication_stream)
    token = _CONTEXT.set(context)
    try:
        yield context
        context.finalize()
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def microbatch(context: FsdpContext, is_last: bool) -> Iterator[None]:
    """Run micro-batches of a step under ``context``; ``is_last=False`` defers the step-end reductions.

    Inside ``microbatch(context, is_last=False)`` the engine accumulates: HSDP's and HFSDP's
    reduction across the outer axis, and the all-reduce of replicated (no_shard, ZeRO-1)
    gradients, wait for the last micro-batch (``is_last=True``), which reduces them once. Sharded
    gradients are reduce-scattered within the inner axis every micro-batch. The first micro-batch
    after a step (after ``is_last=True``) refreshes the weights the optimizer updated.

    Raises:
        RuntimeError: the context's block has not exited.
        TypeError: ``is_last`` not a bool.
    """
    context.ensure_finalized()
    if not isinstance(is_last, bool):
        raise TypeError(f"microbatch: is_last must be True or False, got {is_last!r}")
    previous = context.is_last_microbatch
    context.is_last_microbatch = is_last
    is_first = context._next_is_first
    try:
        with contextlib.ExitStack() as stack:
            for root in context.roots:
                if units_of(cast(nn.Module, root)):
                    stack.enter_context(engine_microbatch(cast(nn.Module, root), is_first, is_last))
            yield
        context._next_is_first = is_last
    finally:
        context.is_last_microbatch = previous

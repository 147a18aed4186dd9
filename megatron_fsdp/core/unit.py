"""FSDPUnit: the runtime of one ``fully_shard``-ed module (docs/design.md section 5).

Its methods are the module's hooks:

    pre_forward    unshard (all-gather) the unit's groups
    post_forward   reshard (ZeRO-3, non-root) and arm the pre-backward hook
    pre_backward   unshard again
    grads ready    (per group, when every trainable parameter's grad arrived)
                   reduce-scatter / all-reduce into the sharded gradients
    post_backward  (autograd reached the unit's inputs) reshard
    finish         the root's end-of-backward callback: reshard, reset
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatron_fsdp.comm.collectives import CommConfig, CommStats
from megatron_fsdp.comm.profiling import REDUCE_ISSUE, REDUCE_WAIT, RESHARD, UNSHARD_ISSUE, UNSHARD_WAIT, trace_range
from megatron_fsdp.core.grad_scaling import GradScaling
from megatron_fsdp.core.lookup import unit_of, units_of
from megatron_fsdp.core.meta_init import materialize_meta
from megatron_fsdp.core.microbatch import MicrobatchFlags
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.options import EngineOptions, differing_root_fields, resolve_options
from megatron_fsdp.core.param_group import ParamGroup
from megatron_fsdp.core.state import RootState
from megatron_fsdp.memory.allocator import pool_for
from megatron_fsdp.memory.grad_buffers import GradSpares
from megatron_fsdp.sharding.strategy import ShardingPlan


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly even when called from a compiled region (``torch.compile`` of a block)."""
    return torch.compiler.disable(hook, recursive=True)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def through_inputs_requiring_grad(node: Callable[..., tuple], args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook's new ``(args, kwargs)``: the tensors that require a gradient passed through
    ``node`` (an identity autograd function whose backward runs once their gradients are computed);
    None where no input requires one."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return None
    for i, tensor in zip(positions, node(*(flat[i] for i in positions))):
        flat[i] = tensor
    return tree_unflatten(flat, spec)


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward signals 'unit backward done'."""

    @staticmethod
    def forward(ctx, unit: FSDPUnit, *inputs: torch.Tensor):
        ctx.unit = unit
        ctx.instance = unit.open_instance(ctx)
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.post_backward(ctx.instance)
        return (None, *grads)


def _own_module_names(module: nn.Module) -> dict[int, str]:
    """``id -> name`` of ``module`` and its submodules, not descending into other units (pre-order)."""
    names: dict[int, str] = {}
    stack = [("", module)]
    while stack:
        name, mod = stack.pop()
        if id(mod) in names:
            continue
        names[id(mod)] = name
        children = [(f"{name}.{n}" if name else n, c) for n, c in mod._modules.items()
                    if c is not None and unit_of(c) is None]
        stack.extend(reversed(children))
    return names


class FSDPUnit:
    """Hooks and state of one sharded module."""

    def __init__(
        self,
        module: nn.Module,
        plan: ShardingPlan,
        reshard_after_forward: bool,
        grad_scaling: GradScaling,
        mp_policy: MixedPrecisionPolicy | None = None,
        options: EngineOptions | None = None,
        others: Sequence[nn.Module] = (),
    ) -> None:
        self._module = weakref.ref(module)
        # fully_shard([a, b, ...]): one unit over several modules; ``module`` is the first.
        self._modules = [weakref.ref(m) for m in (module, *others)]
        self._to_run: set[int] = set()  # grouped: modules whose forward has not run yet in this pass
        # Engine options (core/options.py); an enclosing fully_shard replaces them with
        # its own (``adopt``), so every unit runs with its root's. ``options_given``:
        # passed explicitly, so an enclosing fully_shard must agree with them.
        self.options_given = options is not None
        self.options = resolve_options(options)
        self.comm = CommConfig(self.options.gloo_fast_paths, self.options.side_streams, CommStats())
        self.pool = pool_for(self.options.buffer_pool)
        self.spares = GradSpares()  # the root's serve every unit under it (adopt)
        self.plan = plan
        self.mp_policy = mp_policy
        self.grad_scaling = grad_scaling
        self.groups: list[ParamGroup] = []
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_depth = self.options.prefetch_depth  # units whose all-gather starts while this one computes
        self.requires_gradient_sync = True
        # FSDP2's controls (core/module.py): the root's ``is_last_backward`` decides whether an
        # optimizer step may follow this backward; ``reshard_after_backward=False`` keeps ZeRO-3
        # weights gathered into the next forward (agreed across ranks, core/schedule.py).
        self.is_last_backward = True
        self.reshard_after_backward = True
        # Explicit prefetch lists (set_modules_to_forward/backward_prefetch): units whose
        # all-gathers this unit starts, in the agreed order; None: ``prefetch_depth`` decides.
        self.forward_prefetch: list[FSDPUnit] | None = None
        self.backward_prefetch: list[FSDPUnit] | None = None
        # Weights every rank holds gathered when the next phase starts (an explicit unshard
        # between steps, or kept after backward by agreement): that phase's gather sequence
        # skips this unit's first entry on every rank (core/schedule.py).
        self.weights_held = False
        # Modules of this unit inside their forward, innermost last: a registered forward
        # method (``generate``) calling ``self(...)`` nests the same module.
        self._in_forward: list[int] = []
        self.microbatch: MicrobatchFlags | None = None
        self.root_state: RootState | None = None
        self.state = TrainingState.IDLE
        self.forward_grad_calls = 0  # forwards with grad enabled since the last backward
        self._reshard_when_complete = False
        # Forward passes of this unit whose graph is alive and whose backward has not reached the
        # unit's inputs yet (several: a unit called twice, or two forwards before one backward).
        # Its weights stay gathered until the last one: such a graph may still read them through a
        # frozen parameter, which no gradient hook tracks. A graph dropped unused closes its pass.
        self._open_passes = 0
        # Dynamo never traces the hooks (FSDP2's ``_dynamo_disable``): they run eagerly around a
        # compiled block, which then has no graph break of ours (issue 26).
        for mod in (module, *others):
            mod.register_forward_pre_hook(_eager(self.pre_forward), prepend=True, with_kwargs=True)
            mod.register_forward_hook(_eager(self.post_forward), always_call=True)

    def check_enclosing_options(self, options: EngineOptions, where: str) -> None:
        """Raise if this unit was given options that differ from an enclosing unit's in a root field.

        The units of one root run with its options; a field they must agree on
        (``options.ROOT_FIELDS``) given differently to a unit under it would be
        silently overridden, so it is refused, naming the field.
        """
        differ = differing_root_fields(self.options, options) if self.options_given else []
        if differ:
            raise ValueError(
                f"{where}: a unit under it ({type(self.module).__name__}) was given different options "
                f"({', '.join(f'{d} there' for d in differ)}); the units under one root run with the root's "
                "options: pass the same ones, or options only to the root"
            )

    def adopt(self, root: FSDPUnit) -> None:
        """Run with the options, collectives config (and stats), pool and spares of ``root``, which encloses this."""
        self.check_enclosing_options(root.options, f"fully_shard({type(root.module).__name__})")
        if not self.options_given:
            self.prefetch_depth = root.options.prefetch_depth
        self.options_given = self.options_given or root.options_given
        self.options = root.options
        self.comm = root.comm
        self.pool = root.pool
        self.spares = root.spares
        for group in self.groups:
            group.use(self.comm, self.pool, self.spares)

    @property
    def module(self) -> nn.Module:
        module = self._module()
        assert module is not None, "FSDPUnit outlived its module"
        return module

    @property
    def modules(self) -> list[nn.Module]:
        """The modules this unit shards: one, or several for ``fully_shard([a, b, ...])``."""
        modules = [ref() for ref in self._modules]
        assert all(m is not None for m in modules), "FSDPUnit outlived its module"
        return modules

    @property
    def is_root(self) -> bool:
        return self.root_state is not None and self.root_state.root is self

    # -- gradient-accumulation policy -----------------------------------------
    def enter_microbatch(self, flags: MicrobatchFlags) -> None:
        self.microbatch = flags
        if flags.is_first:
            # Weights kept from the previous step are stale; marked now, before
            # any prefetch of this step can gather them.
            self.mark_weights_stale()

    @property
    def reduces_now(self) -> bool:
        """Reduce gradients in this backward (see ``microbatch``)."""
        if not self.requires_gradient_sync:
            return False
        return self.microbatch is None or self.microbatch.is_last or self.plan.grads

    @property
    def defers_outer_now(self) -> bool:
        """HSDP: this backward's reductions stop inside dp_shard (a non-last ``microbatch``);
        the outer stage runs once, at the last micro-batch or ``finish_grad_sync``."""
        return self.microbatch is not None and not self.microbatch.is_last

    @property
    def optimizer_step_may_follow(self) -> bool:
        """After this backward the main weights may change (not inside accumulation).

        Not when gradients are not synced, inside a non-last ``microbatch``, or after
        the root's ``set_is_last_backward(False)`` (FSDP2's signal that more backwards
        of the same step follow).
        """
        if not self.requires_gradient_sync:
            return False
        root = self.root_state.root if self.root_state is not None else self
        if not root.is_last_backward:
            return False
        return self.microbatch is None or self.microbatch.is_last

    @property
    def gathers_per_use(self) -> bool:
        """ZeRO-3: the weights are gathered at each use, not once per step."""
        return self.plan.params and any(g.gathers for g in self.groups)

    @property
    def holds_gathered_weights(self) -> bool:
        """Every gathering group is gathered or has its all-gather issued (not freed)."""
        return all(g.state.value == "unsharded" or g._gather is not None for g in self.groups if g.gathers)

    def keeps_weights_after_backward(self) -> bool:
        """This rank would keep the ZeRO-3 weights gathered past this backward (``set_reshard_after_backward``)."""
        return (self.gathers_per_use and not self.reshard_after_backward and not self.optimizer_step_may_follow
                and all(g.state.value == "unsharded" for g in self.groups if g.gathers))

    # -- explicit control ---------------------------------------------------
    def prefetch(self) -> None:
        """Start this unit's all-gathers early, unless it is busy or already gathered."""
        if self.state is TrainingState.IDLE:
            self._start_unshard()

    def start_explicit_unshard(self) -> None:
        """The user's ``unshard()``: issue this unit's all-gathers without waiting.

        Inside a forward or backward of its root the gathers go through the schedule
        (issued in the agreed order, core/schedule.py). Between steps they are issued
        directly: like any collective, every rank must call ``unshard`` for the same
        modules in the same order (as with FSDP2), and the next phase then skips this
        unit's gather on every rank (``weights_held``).
        """
        schedule = self.root_state.schedule if self.root_state is not None else None
        if schedule is not None and schedule.phase is not None:
            schedule.prefetch_unit(self)
            return
        self._start_unshard()
        if self.gathers_per_use:
            self.weights_held = True

    def wait_explicit_unshard(self) -> None:
        """Wait for ``start_explicit_unshard``'s gathers and install the unsharded parameters."""
        schedule = self.root_state.schedule if self.root_state is not None else None
        if schedule is not None and schedule.phase is not None:
            schedule.need_weights(self)
            return
        with trace_range(UNSHARD_WAIT, self.device):
            for group in self.groups:
                group.finish_unshard()

    def _start_unshard(self) -> None:
        with trace_range(UNSHARD_ISSUE, self.device):
            for group in self.groups:
                group.start_unshard()

    def unshard(self) -> None:
        self._start_unshard()
        with trace_range(UNSHARD_WAIT, self.device):
            for group in self.groups:
                group.finish_unshard()

    def reshard(self) -> None:
        self.weights_held = False
        with trace_range(RESHARD, self.device):
            for group in self.groups:
                group.reshard()

    @property
    def device(self) -> torch.device | None:
        """Where this unit's parameters live (for NVTX ranges); None without parameters."""
        return self.groups[0].device if self.groups else None

    def release_before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` pre-hook: an idle unit saves its sharded main weights, not gathered copies.

        ZeRO-0/1/2 keep gathered compute weights installed after a forward without
        backward (evaluation) or during accumulation; a state dict taken then would
        hold those (e.g. bf16, unsharded) instead of the main shards. Resharding only
        frees: the next forward gathers again.
        """
        if self.state is TrainingState.IDLE:
            self.reshard()

    def prepare_state_dict_for_load(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict | None = None, *_: Any
    ) -> None:
        """``load_state_dict`` pre-hook: re-cut incoming values into our shards.

        With ``assign=True`` (torch's tutorial recipe with ``distribute_tensor`` values) torch
        would make the value itself the parameter, a tensor outside our flat shard that the
        all-gather never reads: the values are copied into our shard here instead, and the
        entry becomes our own parameter, which torch then assigns in place of itself.
        """
        assign = bool((local_metadata or {}).get("assign_to_params_buffers", False))
        for group, index, key in self._state_keys(module, state_dict, prefix):
            state_dict[key] = group.params[index].loadable(state_dict[key], key, group.dtype)
            if assign:
                param = group.sharded_params[index]
                with torch.no_grad():
                    param.to_local().copy_(state_dict[key].to_local())
                state_dict[key] = param
            # A meta-built parameter has its values now: the initialisation before the first forward
            # (materialize_meta) must not overwrite them (torch's meta-device loading recipe).
            group.pending_init.discard(index)
        self.mark_weights_stale()  # the main weights are about to change

    def _state_keys(self, module: nn.Module, state_dict: dict, prefix: str) -> Iterator[tuple[ParamGroup, int, str]]:
        """(group, index, key) of this unit's parameters registered under ``module`` and present in ``state_dict``.

        Keys are found through the (module, attribute) uses under ``module``: a grouped unit
        registers its hooks on each of its modules, and each sees only its own parameters.
        """
        names = _own_module_names(module)
        for group in self.groups:
            for index, ref in enumerate(group.refs):
                for owner, attr in ref.uses:
                    if id(owner) not in names:
                        continue
                    key = prefix + (f"{names[id(owner)]}." if names[id(owner)] else "") + attr
                    if key in state_dict:
                        yield group, index, key

    # -- forward ------------------------------------------------------------
    def _lazy_init_root(self) -> None:
        if len(self._modules) > 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"fully_shard([{names}]) ran forward before any unit enclosing it: a unit over several modules "
                "cannot be the root; apply fully_shard to a module that encloses them (the model) as well"
            )
        RootState(self, units_of(self.module))
        materialize_meta(self.module)  # no-op unless built on the meta device

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.root_state is None:
            self._lazy_init_root()
        if len(self._modules) > 1 and not self._to_run and self.state is not TrainingState.BACKWARD:
            self._to_run = {id(m) for m in self.modules}  # grouped: a pass over the modules starts
        for group in self.groups:
            group.check_unchanged()
        if self.state is TrainingState.FORWARD and id(module) in self._in_forward:
            # A forward inside this module's own forward (a registered forward method such
            # as ``generate`` calling ``self(...)``): the weights stay gathered until the
            # outermost one ends; it opens no new phase. (The modules of a grouped unit
            # running one after the other are not nested: each has ended before the next.)
            self._in_forward.append(id(module))
            return self._enter_forward(args, kwargs)
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.FORWARD
            self._in_forward.append(id(module))
        if self.is_root and self.state is not TrainingState.BACKWARD:
            self.root_state.begin_forward()
        if self.state is TrainingState.FORWARD:  # not a recomputation inside backward
            self.root_state.record_forward(self)
        return self._enter_forward(args, kwargs)

    def _enter_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.state is TrainingState.FORWARD:
            self.forward_grad_calls += torch.is_grad_enabled()
        self.root_state.need_weights(self)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs) or (args, kwargs)
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args, kwargs) if self.mp_policy is None else self.mp_policy.cast_inputs(args, kwargs)

    def _cast_outputs(self, output: Any) -> Any:
        return output if self.mp_policy is None else self.mp_policy.cast_outputs(output)

    def mark_weights_stale(self) -> None:
        """Main weights may have changed: refresh and re-gather before the next use."""
        self.reshard()
        for group in self.groups:
            group.mark_compute_stale()

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return through_inputs_requiring_grad(lambda *inputs: _PostBackward.apply(self, *inputs), args, kwargs)

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.state is TrainingState.BACKWARD:
            # Recomputation inside backward (activation checkpointing): the
            # unit's backward still needs its weights.
            return self._cast_outputs(output)
        if self._in_forward:
            self._in_forward.pop()
        if id(module) in self._in_forward:  # a nested forward of this module ended; the outer one goes on
            return self._arm_pre_backward(output)
        if len(self._modules) > 1:
            # Grouped: the pass ends with the last of its modules (FSDP2's semantics);
            # a module run again within the pass only casts its output.
            if id(module) not in self._to_run:
                return self._cast_outputs(output)
            self._to_run.discard(id(module))
            if self._to_run:
                return self._cast_outputs(output)
        if self.is_root:
            # Grouped units whose modules did not all run (e.g. a loss head called
            # after the model's forward) end their pass with the root's.
            for unit in self.root_state.units:
                if unit._to_run and unit is not self:
                    unit._to_run = set()
                    output = unit._end_forward_pass(output)
        return self._end_forward_pass(output)

    def _end_forward_pass(self, output: Any) -> Any:
        """Reshard (ZeRO-3, non-root), arm the pre-backward hook on ``output``, cast it."""
        self._in_forward.clear()
        if self.plan.params and self.reshard_after_forward and not self.is_root:
            self.reshard()
        self.state = TrainingState.IDLE
        if self.is_root:
            self.root_state.end_forward()
        return self._arm_pre_backward(output)

    def _arm_pre_backward(self, output: Any) -> Any:
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, _eager(self.pre_backward), mode="any")
        return self._cast_outputs(output)

    # -- backward -----------------------------------------------------------
    def pre_backward(self, *_: Any) -> None:
        if torch.is_grad_enabled() and any(g.gathers for g in self.groups):
            # The engine runs backward hooks in grad mode only under create_graph=True.
            raise RuntimeError(
                f"megatron_fsdp: a backward with create_graph=True (double backward, e.g. a gradient "
                f"penalty) reached unit '{type(self.module).__name__}', whose weights are gathered "
                f"(sharding_strategy={self.plan.name!r}): they are released when that backward ends, "
                "but the graph create_graph builds reads them in the next one. Use "
                "sharding_strategy='no_shard' for such a model, or a penalty that needs no create_graph."
            )
        self.state = TrainingState.BACKWARD
        if self.root_state is None:
            self.unshard()
        else:
            self.root_state.begin_backward()
            self.root_state.need_weights(self)

    def on_grads_ready(self, group: ParamGroup) -> None:
        """Every trainable parameter of ``group`` has its gradient: reduce it when its turn comes."""
        if self.root_state is not None:
            with trace_range(REDUCE_ISSUE, self.device):
                self.root_state.schedule.advance_reductions()
        else:
            reduce = group.reduce_grads(self.reduces_now, self.grad_scaling, defer_outer=self.defers_outer_now)
            if reduce is not None:
                with trace_range(REDUCE_WAIT, self.device):
                    reduce.finish()
        if self._reshard_when_complete and self._grads_complete:
            self._reshard_when_complete = False
            self.reshard()

    @property
    def _grads_complete(self) -> bool:
        return all(g.grads_complete for g in self.groups if g.requires_grad)

    def open_instance(self, node: object) -> list[bool] | None:
        """A forward pass registered its post-backward ``node``; recomputations in backward are not counted.

        Returns the pass's token (``[closed]``), closed by ``post_backward`` or when ``node`` (the
        pass's graph) is freed without its backward reaching this unit.
        """
        if self.state is not TrainingState.FORWARD:
            return None
        token = [False]
        self._open_passes += 1
        weakref.finalize(node, self._close_pass, token)
        return token

    def _close_pass(self, token: list[bool]) -> None:
        if not token[0]:
            token[0] = True
            self._open_passes -= 1

    def post_backward(self, token: list[bool] | None = None) -> None:
        """Autograd computed the gradients of the unit's inputs (for the forward pass of ``token``)."""
        if token is not None:
            self._close_pass(token)
        if not self.plan.params or not self.reshard_after_backward or self._open_passes > 0:
            return
        if self._grads_complete:
            self.reshard()
        else:  # its weights' gradients are still being computed
            self._reshard_when_complete = True

    def finish_backward(self, keep_weights: bool = False) -> None:
        """End of backward (called by the root): release weights, reset state.

        ``keep_weights``: every rank keeps this unit's gathered ZeRO-3 weights for the
        next forward (``set_reshard_after_backward(False)``, agreed by the schedule).
        """
        if self.optimizer_step_may_follow:
            # Gathered weights and low-precision compute copies go stale at the
            # optimizer step: release them; the next forward refreshes them.
            self.mark_weights_stale()
        elif keep_weights:
            self.weights_held = True
        elif self.plan.params:
            self.reshard()  # ZeRO-3 releases weights between uses even mid-accumulation
        for group in self.groups:
            group.end_backward()
        self.forward_grad_calls = 0
        self._reshard_when_complete = False
        self._to_run = set()
        self.state = TrainingState.IDLE

"""NVTX ranges of the placements API: ``MFSDP <name> forward`` / ``MFSDP <name> backward`` per ``FsdpModule``.

Megatron-LM v2's hooks push one range per module pass, so a profile shows which module a
gather or reduction belongs to: ``<name>`` is the module's name under its root (``<root>`` for a
root). Forward: from the module's pre-forward hook to its post-forward hook. Backward: from the
first gradient reaching one of its outputs to the gradients of its inputs being computed (an
identity autograd node on the inputs that require a gradient), or, where no input requires one
(a root fed token ids), to the end of that backward. A module outside the backward graph (its
outputs need no gradient) pushes no backward range; ranges always balance.

The ranges go through ``torch.cuda.nvtx.range_push`` / ``range_pop``, looked up at each call (a
profiler or a test may replace them). On a CPU build of torch those raise (NVTX is not installed):
the range is then skipped, push and pop alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from megatron_fsdp.core.lookup import unit_of
from megatron_fsdp.core.unit import TrainingState, through_inputs_requiring_grad

# module.__dict__ key: one entry per forward of the module in progress (nested calls stack up): whether its
# forward range was pushed, and its backward range (None without one)
_PASSES_ATTR = "_megatron_fsdp_experimental_nvtx"


def _push(label: str) -> bool:
    try:
        torch.cuda.nvtx.range_push(label)
    except RuntimeError:  # a CPU build of torch: NVTX is not installed
        return False
    return True


def _pop() -> None:
    try:
        torch.cuda.nvtx.range_pop()
    except RuntimeError:
        pass


class _BackwardRange:
    """One forward pass's backward range: pushed once, popped once (by the input node or at the end)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.pushed = False
        self.open = False

    def push(self, *_: Any) -> None:
        if self.pushed:
            return
        self.pushed = True
        self.open = _push(self.label)
        if self.open:
            # Closes the range at the end of this backward unless the inputs' node closed it before.
            Variable._execution_engine.queue_callback(self.pop)

    def pop(self) -> None:
        if self.open:
            self.open = False
            _pop()


class _CloseOnInputGrads(torch.autograd.Function):
    """Identity on the module's inputs; its backward (their gradients computed) closes the backward range."""

    @staticmethod
    def forward(ctx: Any, backward_range: _BackwardRange, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.backward_range = backward_range
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.backward_range.pop()
        return (None, *grads)


def _label(module: nn.Module, phase: str) -> str:
    name = "<root>" if module.is_root() else module.name  # type: ignore[operator]
    return f"MFSDP {name} {phase}"


def _recomputing(module: nn.Module) -> bool:
    """A forward inside backward (activation recomputation): it has no backward range of its own."""
    unit = unit_of(module)
    return unit is not None and unit.state is TrainingState.BACKWARD


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    passes = module.__dict__.setdefault(_PASSES_ATTR, [])
    pushed = _push(_label(module, "forward"))
    if not torch.is_grad_enabled() or _recomputing(module):
        passes.append((pushed, None))
        return None
    backward_range = _BackwardRange(_label(module, "backward"))
    passes.append((pushed, backward_range))
    return through_inputs_requiring_grad(lambda *inputs: _CloseOnInputGrads.apply(backward_range, *inputs),
                                         args, kwargs)


def _post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    passes = module.__dict__.get(_PASSES_ATTR)
    if not passes:
        return
    pushed, backward_range = passes.pop()
    if backward_range is not None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, backward_range.push, mode="any")
    if pushed:
        _pop()


def add_nvtx_ranges(module: nn.Module) -> None:
    """Push and pop ``module``'s forward and backward ranges (``fully_shard`` calls it once per module,
    after the engine's hooks: the forward range then spans the engine's gather and release, and the
    backward range its post-backward reduction)."""
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True, prepend=True)
    module.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)

"""``MegatronFSDP``: the whole-model wrapper Megatron's training loop drives.

It holds a model already sharded with ``fully_shard`` (bottom-up, root last;
``fully_shard_model`` builds it) at ``.module`` and adds the methods Megatron's
loop calls on its data-parallel wrappers. There is no second engine: every
method is a few calls on the model's ``FSDPUnit``s, and the same per-step
operations (``core.steps``: ``finish_grad_sync``, ``install_weights``,
``discard_grad_buffers``, ``scale_grads``) serve the optimizer wrapper
(``optim.optimizer``), which finds the units from the sharded parameters it steps.

The wrapper is transparent to names (``TransparentWrapper``): ``state_dict()``,
``load_state_dict()``, ``named_parameters()`` and PyTorch's DCP state-dict helpers
use the wrapped model's own FQNs, never a ``module.`` prefix, so a checkpoint moves
between this wrapper, per-module ``fully_shard``, DDP, FSDP2 and the plain model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.comm.collectives import broadcast
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.microbatch import MicrobatchFlags
from megatron_fsdp.core.module import FSDPModule
from megatron_fsdp.core.steps import (
    discard_grad_buffers,
    finish_grad_sync,
    install_weights,
    named_sharded_parameters,
    scale_grads,
    start_grad_sync,
    stop_communication,
)
from megatron_fsdp.core.unit import FSDPUnit
from megatron_fsdp.optim.grad_norm import check_grads_finite, clip_grad_norm_, sharded_parameters


class TransparentWrapper(nn.Module):
    """An ``nn.Module`` wrapper (the wrapped model at ``.module``) that is transparent to names.

    ``state_dict()`` / ``load_state_dict()`` keys, ``named_parameters()`` and
    ``named_buffers()`` are the wrapped model's own FQNs (no ``module.`` prefix),
    and PyTorch's ``torch.distributed.checkpoint.state_dict`` helpers (model and
    optimizer state dicts) see the same names through ``_fqn_modifiers``, the
    hook DCP offers wrappers. So checkpoints of the wrapped model load into the
    plain model, DDP, FSDP2 or per-module ``fully_shard`` and the other way round,
    as PyTorch's FSDP1 and megatron-core's data-parallel wrappers do for their
    own prefixes. ``named_modules()`` still lists the wrapper and ``module``.
    Wrappers may nest (the Megatron adapter holds a ``MegatronFSDP``). Inside a
    parent module, the parent's ``state_dict()`` / ``load_state_dict()`` drop
    this wrapper's ``module.`` too (hooks below), while the parent's
    ``named_parameters()`` keeps it (PyTorch builds that from ``named_modules()``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_TransparentNames.add_prefix)
        self.register_load_state_dict_post_hook(_TransparentNames.strip_from_report)

    @property
    def _transparent_root(self) -> nn.Module:
        """The innermost wrapped module: the one whose FQNs this wrapper shows."""
        module = self.module
        while isinstance(module, TransparentWrapper):
            module = module.module
        return module

    def _fqn_modifiers(self) -> dict[str, str]:
        # DCP's FQN walk (torch.distributed.checkpoint.state_dict._get_fqns): for a first name
        # component found here, step into the attribute it maps to (our innermost module) first.
        # Its state-dict walk drops a child whose attribute name is among the values ("module").
        modifiers = {name: "_transparent_root" for name in self._transparent_root._modules}
        modifiers[""] = "module"
        return modifiers

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict, keys without this wrapper's ``module.`` prefix."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict keyed by the wrapped module's FQNs (as ``state_dict()`` gives them)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under its own names."""
        yield from super().named_parameters(prefix, recurse=False, remove_duplicate=remove_duplicate)
        if recurse:
            yield from self.module.named_parameters(prefix, recurse=True, remove_duplicate=remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers under its own names."""
        yield from super().named_buffers(prefix, recurse=False, remove_duplicate=remove_duplicate)
        if recurse:
            yield from self.module.named_buffers(prefix, recurse=True, remove_duplicate=remove_duplicate)


class _TransparentNames:
    """``load_state_dict`` hooks for a ``TransparentWrapper`` loaded as part of a parent module.

    The parent's ``load_state_dict`` walks its children itself (it never calls the
    wrapper's ``load_state_dict``), so the keys it hands down lack ``module.``:
    the pre-hook adds it, the post-hook removes it again from missing/unexpected keys.
    """

    PREFIX_ATTR = "_transparent_load_prefix"

    @staticmethod
    def add_prefix(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[f"{prefix}module.{key[len(prefix):]}"] = state_dict.pop(key)
        module.__dict__[_TransparentNames.PREFIX_ATTR] = prefix

    @staticmethod
    def strip_from_report(module: nn.Module, report: Any) -> None:
        prefix = module.__dict__.pop(_TransparentNames.PREFIX_ATTR, None)
        if prefix is None:
            return
        inner = f"{prefix}module."
        for keys in (report.missing_keys, report.unexpected_keys):
            keys[:] = [prefix + k[len(inner):] if k.startswith(inner) else k for k in keys]


class MegatronFSDP(TransparentWrapper):
    """A ``fully_shard``-ed model with the data-parallel methods of Megatron's training loop.

    Built by :func:`megatron_fsdp.fully_shard_model`; constructing it directly
    needs a module on which ``fully_shard`` was already applied (root included).

    Args:
        module: the sharded root module (kept at ``.module``).
        sync_model_each_microbatch: True: every backward reduces its gradients
            and waits for them, and weights are re-gathered from the main shards
            after it (the engine's default). False: backward passes accumulate
            as micro-batches of one step (``megatron_fsdp.microbatch`` semantics):
            ZeRO-1/2 weights stay gathered and full-size gradients stay local
            until ``finish_grad_sync()`` (or ``optimizer.step()`` of a
            ``fully_shard_optimizer``-ed optimizer), which must then be called.
        check_for_nan_in_grad: ``finish_grad_sync()`` raises, on every rank,
            naming the parameters whose reduced gradient holds NaN/Inf.
    """

    def __init__(
        self, module: nn.Module, *, sync_model_each_microbatch: bool = False, check_for_nan_in_grad: bool = False
    ) -> None:
        super().__init__()
        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"MegatronFSDP wraps a module sharded with fully_shard (root included); {type(module).__name__} "
                "is not: use megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[...]) instead"
            )
        self.module = module
        self.sync_model_each_microbatch = bool(sync_model_each_microbatch)
        self.check_for_nan_in_grad = bool(check_for_nan_in_grad)
        self._next_microbatch_is_first = True

    @property
    def fsdp_units(self) -> list[FSDPUnit]:
        return units_of(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.sync_model_each_microbatch and torch.is_grad_enabled():
            # A micro-batch of the current step; the step ends at finish_grad_sync().
            flags = MicrobatchFlags(is_first=self._next_microbatch_is_first, is_last=False)
            for unit in self.fsdp_units:
                unit.enter_microbatch(flags)
            self._next_microbatch_is_first = False
        return self.module(*args, **kwargs)

    # -- gradients ------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without reducing them, inside the block."""
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        """Start the reduction of gradients not reduced yet (accumulated under ``no_sync``)."""
        start_grad_sync(self.fsdp_units)

    def finish_grad_sync(self, *unused: Any) -> None:
        """Reduce and wait for every gradient; ready for the optimizer step.

        The weights are marked stale (the step will change them), ends the
        step's micro-batch sequence, and checks for NaN/Inf if asked to.
        """
        units = self.fsdp_units
        finish_grad_sync(units)
        self._next_microbatch_is_first = True
        if self.check_for_nan_in_grad:
            check_grads_finite(named_sharded_parameters(units, self.module))

    def zero_grad_buffer(self) -> None:
        """Zero all gradients: unreduced accumulation buffers and the reduced sharded ``.grad``."""
        discard_grad_buffers(self.fsdp_units)
        self._next_microbatch_is_first = True

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient (reduced or still accumulating) by ``scaling_factor``."""
        scale_grads(self.fsdp_units, float(scaling_factor))

    # -- weights ----------------------------------------------------------------
    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """The main weights were updated: install them (refresh compute copies; re-gather on next use)."""
        install_weights(self.fsdp_units, eager=True)
        self._next_microbatch_is_first = True

    def install_optimized_model_weights(self) -> None:
        """Same as ``start_param_sync()``: make the next forward use the updated main weights."""
        self.start_param_sync()

    def broadcast_params(self) -> None:
        """Make every data-parallel replica hold data-parallel rank 0's weights.

        Sharded weights are already one copy split across ``dp_shard``; what is
        replicated (unsharded groups over ``dp_shard``, groups over ``dp_outer``
        unless ``outer_dp_sharding_strategy="optim"`` split them) is broadcast
        from the first rank of its group.
        """
        units = self.fsdp_units
        with torch.no_grad():
            for unit in units:
                for group in unit.groups:
                    if not group.gathers and group.dp.shard_size > 1:
                        broadcast(group.shard, 0, group.process_group, comm=group.comm).wait()
                    # Under outer 'optim' each dp_outer rank holds a different piece: nothing is replicated.
                    if group.dp.has_outer and group.dp.outer_size > 1 and getattr(group, "outer", None) is None:
                        broadcast(group.shard, 0, group.dp.outer_group, comm=group.comm).wait()
        install_weights(units, eager=False)

    def stop_communication(self) -> None:
        """Wait for every reduction and all-gather in flight (before a checkpoint or exit)."""
        stop_communication(self.fsdp_units)

    # -- helpers ----------------------------------------------------------------
    def sharded_parameters(self) -> list[nn.Parameter]:
        """The sharded (DTensor) parameters the optimizer steps, whatever is installed now."""
        return sharded_parameters(self.module)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (all shards, all replicas) to ``max_norm``; return it."""
        return clip_grad_norm_(self.module, max_norm, norm_type)

    def extra_repr(self) -> str:
        world = dist.get_world_size() if dist.is_initialized() else 1
        sync = self.sync_model_each_microbatch
        return f"units={len(self.fsdp_units)}, world={world}, sync_model_each_microbatch={sync}"

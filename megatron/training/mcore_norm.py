"""Norms for megatron-core's local layer spec under sequence parallelism, on CPU.

Without Apex, megatron-core's local spec builds its norms with ``WrappedTorchNorm``
(``torch.nn.LayerNorm`` / ``RMSNorm``), which asserts ``not config.sequence_parallel``
(``transformer/torch_norm.py``); Apex's ``FusedLayerNorm`` (CUDA) is the local spec's norm
that takes it. Under sequence parallelism a norm is the same computation on this TP
rank's part of the sequence; what changes is its gradient, a partial sum per TP rank,
which the training loop sums over TP for parameters marked ``sequence_parallel``
(Megatron's ``finalize_model_grads`` / ``_allreduce_non_tensor_model_parallel_grads``, the
front-end's ``allreduce_sequence_parallel_grads``). ``SequenceParallelTorchNorm`` is
``WrappedTorchNorm`` with that: the same torch module and parameter names, its parameters
marked ``sequence_parallel`` as ``FusedLayerNorm`` marks them. It replaces
``WrappedTorchNorm`` in megatron-core's own layer and block specs
(``with_sequence_parallel_norms``): a layer spec, not a patch.

Imported only where megatron-core is installed (``mcore_model._layer_spec``).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelTorchNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` for megatron-core's specs, accepting ``config.sequence_parallel``.

    Returns the torch module itself (as ``WrappedTorchNorm`` does: parameter names
    ``weight`` / ``bias``, so checkpoints are those of the torch-norm spec), with each
    parameter's ``sequence_parallel`` attribute set to ``config.sequence_parallel``.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        # WrappedTorchNorm's other refusals, kept: the torch norms have none of these
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma, persist_layer_norm and memory_efficient_layer_norm are not "
                             "supported by torch's norms")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: only LayerNorm and RMSNorm under sequence "
                             "parallelism here")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _swap(value):
    """``value`` with every ``WrappedTorchNorm`` inside it (a spec, a submodules dataclass) replaced, in place."""
    if value is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(value, ModuleSpec):
        if value.module is WrappedTorchNorm:
            value.module = SequenceParallelTorchNorm
        value.submodules = _swap(value.submodules)
        return value
    if isinstance(value, list):
        return [_swap(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            setattr(value, field.name, _swap(getattr(value, field.name)))
    return value


def with_sequence_parallel_norms(spec: ModuleSpec | TransformerBlockSubmodules, num_layers: int
                                 ) -> TransformerBlockSubmodules:
    """megatron-core's block spec (or a layer spec, made the block spec megatron-core would make of it:
    ``num_layers`` of it and a final norm) with ``SequenceParallelTorchNorm`` for every torch norm."""
    if isinstance(spec, ModuleSpec):
        spec = TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=WrappedTorchNorm)
    return _swap(spec)


__all__ = ["SequenceParallelTorchNorm", "with_sequence_parallel_norms"]

"""``--use-torch-fsdp2``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) as the front-end's third backend.

Megatron-LM wraps megatron-core models in megatron-core's ``TorchFullyShardedDataParallel``:
``fully_shard`` on each ``TransformerLayer``, the ``LanguageModelEmbedding`` (and, with
TransformerEngine, the output ``ColumnParallelLinear``), then on the root, over the
data-parallel group, with the parameters' Megatron attributes saved before and restored
after (FSDP2 replaces the parameters). This module does the same with ``fully_shard``
directly, for our GPT and megatron-core's alike, because megatron-core's class cannot
serve here: it builds its mesh with ``DeviceMesh.from_group(group, "cuda")`` whatever the
device, and it has no mixed-precision policy (Megatron pairs it with ``Float16Module`` and
its own fp32-main-parameter optimizer, which this front-end does not have). With ``--bf16``
FSDP2's ``MixedPrecisionPolicy`` gives what our FSDP backend gives: fp32 sharded (main)
parameters that the optimizer steps, bf16 compute, gradients reduced in fp32 (bf16 with
``--grad-reduce-in-bf16``).

What differs from our engine is only the wrapper, so a run can A/B the three backends with
one flag (tests/functional/configs.py compares them); ``backends.TorchFSDP2Backend`` drives it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from megatron_fsdp.mcore import default_unit_modules

from .parallel_state import ParallelLayout


def _fsdp2_units(model: nn.Module, untied: bool) -> list[nn.Module]:
    """The modules Megatron-LM's ``TorchFullyShardedDataParallel`` shards on their own, in order.

    Transformer layers (ours and megatron-core's); megatron-core's ``LanguageModelEmbedding``
    only with untied embeddings: tied, the output layer reads the embedding's weight outside
    the embedding's forward, so both stay in the root unit (Megatron-LM refuses tied
    embeddings with FSDP2 instead; here they work).
    """
    classes = tuple(default_unit_modules(model))
    units = [m for m in model.modules() if classes and isinstance(m, classes)]
    if untied:
        with contextlib.suppress(ImportError):
            from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

            units = [m for m in model.modules() if isinstance(m, LanguageModelEmbedding)] + units
    return units


def wrap_with_torch_fsdp2(model: nn.Module, device: torch.device, layout: ParallelLayout, *, bf16: bool,
                          grad_reduce_in_bf16: bool, untied: bool, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` the model's units and its root over ``layout``'s gradient group (DP x CP).

    The parameters' attributes (``tensor_model_parallel``, ``sequence_parallel``,
    ``allreduce`` ...) are copied onto FSDP2's new DTensor parameters, as megatron-core's
    wrapper does (pytorch/pytorch#136929): the gradient norm and the checkpoint read them.
    """
    mesh = DeviceMesh.from_group(layout.grad_group, device.type)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.bfloat16 if bf16 and grad_reduce_in_bf16 else torch.float32,
    )
    attrs = {name: dict(vars(param)) for name, param in model.named_parameters()}
    for unit in _fsdp2_units(model, untied):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for name, param in model.named_parameters():
        for key, value in attrs.get(name, {}).items():
            setattr(param, key, value)
    return model


__all__ = ["wrap_with_torch_fsdp2"]

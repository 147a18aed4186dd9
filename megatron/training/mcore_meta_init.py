"""``--init-model-with-meta-device`` on megatron-core's ``GPTModel``: each module's initialiser as megatron-core ran it.

megatron-core 0.16.1 initialises its layers' weights inside their constructors (with
``use_cpu_initialization``, which the front-end sets on CPU: ``_initialize_affine_weight_cpu``
builds the full master weight with the config's init method, from the default generator, and keeps
this TP rank's slice; biases zero; the router's and the position embeddings' weights by the
config's init method), and its ``ColumnParallelLinear``, ``RowParallelLinear`` and
``VocabParallelEmbedding`` have no ``reset_parameters``. Built under ``torch.device("meta")`` those
constructors draw nothing, and the engine's ``materialize_meta`` (megatron_fsdp/core/meta_init.py)
runs each managed module's ``reset_parameters()`` on temporaries, in module pre-order, once the model
is sharded.

``bind_initializers(model)`` gives every module of the meta-built model that holds parameters a
``reset_parameters`` of its own (an instance attribute: megatron-core's classes are not touched) that
re-runs megatron-core's construction-time initialisation of that module: the same function
(``_initialize_affine_weight_cpu``), the same init method (the one the module's constructor was
given: ``init_method`` for column-parallel layers and the router, ``output_layer_init_method`` for
row-parallel layers, ``embedding_init_method`` for embeddings), the same shapes, dtypes, strides and
TP rank. The modules' pre-order is their construction order (each module's parameters are built by
its own constructor, before the next module is built), so the materialised weights are bitwise the
eager build's for the same ``--seed``: the default generator stands at the state megatron-core's
constructors started from (``model_parallel_cuda_manual_seed`` reseeds it in the model provider, and
nothing draws from it between the meta build and the wrap, where the engine materialises). Each value is
then rounded to the dtype of its meta-built parameter, as the eager weights were (``--bf16``).

A module type this file does not know, or a module whose own parameters its constructor
initialises after its children's (megatron-core's shared-expert gate), stops the build with a
``UsageError`` naming the module and the flag: never a silently uninitialised parameter.

Imported only where megatron-core is installed (``mcore_model.mcore_gpt_model``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _initialize_affine_weight_cpu,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import nn

from .errors import UsageError

FLAG = "--init-model-with-meta-device"

# Modules whose class ``reset_parameters`` is what their constructor ran, drawing nothing from the generator
# (ones and zeros): torch's norms, which megatron-core's local layer spec builds (WrappedTorchNorm) and
# mcore_norm.py's sequence-parallel norms subclass.
_CLASS_RESET_IS_CONSTRUCTION = (nn.LayerNorm, nn.RMSNorm)


def _column_parallel_linear(module: ColumnParallelLinear, stride: int) -> None:
    """``ColumnParallelLinear.__init__``'s CPU initialisation (tensor_parallel/layers.py, lines 849-867 and
    890-907 of 0.16.1): the full ``[output, input]`` master weight by ``config.init_method``, this TP rank's rows
    (the master weight is fp32, as the constructor passes no ``params_dtype``), then the bias zero."""
    if module.weight is not None:
        _initialize_affine_weight_cpu(
            module.weight, module.output_size, module.input_size, module.output_size_per_partition, 0,
            module.config.init_method, stride=stride, rank=get_pg_rank(module.tp_group),
            world_size=get_pg_size(module.tp_group), skip_set_tensor_parallel_attributes=True)
    if module.bias is not None:
        module.bias.zero_()


def _row_parallel_linear(module: RowParallelLinear, stride: int, discarded_input_size: int | None) -> None:
    """``RowParallelLinear.__init__``'s CPU initialisation (lines 1172-1191 and 1211-1226 of 0.16.1): the full
    master weight by ``config.output_layer_init_method`` in ``params_dtype``, this TP rank's columns; bias zero.

    ``discarded_input_size``: multi-latent attention's ``linear_proj``. ``MultiLatentAttention.__init__`` first
    runs ``Attention.__init__``, which builds (and initialises) a ``linear_proj`` of input size
    ``kv_channels x heads`` (transformer/attention.py, line 349 of 0.16.1), then builds its own in its place
    (transformer/multi_latent_attention.py, line 169): eager draws the discarded weight first, and so does this."""
    rank, world = get_pg_rank(module.tp_group), get_pg_size(module.tp_group)
    dtype = module.config.params_dtype
    if discarded_input_size is not None:
        per_partition = discarded_input_size // world
        _initialize_affine_weight_cpu(
            torch.empty(module.output_size, per_partition, dtype=dtype), module.output_size, discarded_input_size,
            per_partition, 1, module.config.output_layer_init_method, params_dtype=dtype, rank=rank,
            world_size=world, skip_set_tensor_parallel_attributes=True)
    _initialize_affine_weight_cpu(
        module.weight, module.output_size, module.input_size, module.input_size_per_partition, 1,
        module.config.output_layer_init_method, stride=stride, params_dtype=dtype, rank=rank, world_size=world,
        skip_set_tensor_parallel_attributes=True)
    if module.bias is not None:
        module.bias.zero_()


def _vocab_parallel_embedding(module: VocabParallelEmbedding, config) -> None:
    """``VocabParallelEmbedding.__init__``'s CPU initialisation (lines 238-255 of 0.16.1), with the init method
    ``LanguageModelEmbedding`` gives it (``config.embedding_init_method``)."""
    _initialize_affine_weight_cpu(
        module.weight, module.num_embeddings, module.embedding_dim, module.num_embeddings_per_partition, 0,
        config.embedding_init_method, params_dtype=config.params_dtype, rank=get_pg_rank(module.tp_group),
        world_size=get_pg_size(module.tp_group), skip_set_tensor_parallel_attributes=True)


def _serial_embedding(module: nn.Embedding, config) -> None:
    """``LanguageModelEmbedding``'s position (and token-type) embedding: ``torch.nn.Embedding``'s own
    initialisation (its constructor's), then ``config.embedding_init_method`` over it
    (models/common/embeddings/language_model_embedding.py, lines 66-73 of 0.16.1)."""
    weight = torch.empty(module.weight.shape)  # built in torch's default dtype (the front-end casts it for --bf16)
    nn.init.normal_(weight)  # nn.Embedding.reset_parameters (no padding index here)
    config.embedding_init_method(weight)
    module.weight.copy_(weight)


_ROUTER_ZERO_BUFFERS = ("local_tokens_per_expert", "expert_bias", "global_tokens_per_expert", "ga_steps")


def _router(module: TopKRouter) -> None:
    """``Router.__init__`` and its ``reset_parameters`` (transformer/moe/router.py, lines 52-76 of 0.16.1): the
    weight (and bias) built in fp32, initialised by ``config.init_method``, then cast to ``params_dtype``. Written
    into the parameters in place (megatron-core's ``reset_parameters`` rebinds ``.data``, which would leave the
    engine's temporaries unwritten where the dtypes differ)."""
    config = module.config
    weight = torch.empty(module.weight.shape, dtype=torch.float32)
    config.init_method(weight)
    module.weight.copy_(weight.to(config.params_dtype))
    if module.bias is not None:
        bias = torch.empty(module.bias.shape, dtype=torch.float32)
        config.init_method(bias)
        module.bias.copy_(bias.to(config.params_dtype))
    for name in _ROUTER_ZERO_BUFFERS:  # TopKRouter.__init__'s (lines 162-200): zeros
        buffer = getattr(module, name, None)
        if buffer is not None:
            buffer.zero_()


def _in_model_dtype(module: nn.Module, built: dict[str, nn.Parameter], init: Callable[[], None]) -> None:
    """``init()``, then each parameter rounded to the dtype of the meta-built parameter ``built`` at that moment.

    The engine's temporaries are in its main-weight dtype: fp32 under ``--bf16`` (preserve_fp32_weights), where
    the eager build's weights are bf16 (megatron-core's ``params_dtype``, then the front-end's ``model.to``) and
    its fp32 main weights are their widening; the meta-built parameters were cast alike, so their dtype says
    what the eager weights were rounded to."""
    init()
    for name, param in built.items():
        value = getattr(module, name)
        if value.is_floating_point() and value.dtype != param.dtype:
            value.copy_(value.to(param.dtype))


def _unknown(fqn: str, module: nn.Module, why: str) -> UsageError:
    names = [name for name, _ in module.named_parameters(recurse=False)]
    return UsageError(
        f"{FLAG}: megatron-core's {type(module).__name__} ({fqn or 'the model'}, parameters {names}) {why}; the "
        "front-end cannot give it the values an eager build would (megatron/training/mcore_meta_init.py). Drop "
        f"{FLAG} for this model")


def _initializer(fqn: str, module: nn.Module, parent: nn.Module | None, config) -> Callable[[], None] | None:
    """``module``'s construction-time initialisation as a function of no arguments; None where its class's
    ``reset_parameters`` already is it. Raises ``UsageError`` where neither is known."""
    # Exact types: a subclass may build or initialise more than what is replayed here.
    kind = type(module)
    if kind is ColumnParallelLinear:
        stride = getattr(module.weight, "partition_stride", 1) if module.weight is not None else 1
        return functools.partial(_column_parallel_linear, module, stride)
    if kind is RowParallelLinear:
        discarded = None
        if isinstance(parent, MultiLatentAttention) and parent.linear_proj is module:
            discarded = parent.config.kv_channels * parent.config.num_attention_heads
        return functools.partial(_row_parallel_linear, module, getattr(module.weight, "partition_stride", 1),
                                 discarded)
    if kind is VocabParallelEmbedding:
        return functools.partial(_vocab_parallel_embedding, module, config)
    if kind is TopKRouter:
        return functools.partial(_router, module)
    if kind is nn.Embedding and type(parent).__name__ == "LanguageModelEmbedding":
        return functools.partial(_serial_embedding, module, config)
    if isinstance(module, _CLASS_RESET_IS_CONSTRUCTION) and not any(True for _ in module.children()):
        return None
    raise _unknown(fqn, module, "holds parameters that its constructor initialises in a way this front-end does not "
                   "replay")


def bind_initializers(model: nn.Module) -> int:
    """Give each module of the meta-built megatron-core ``model`` that holds parameters a ``reset_parameters``
    that re-runs megatron-core's construction-time initialisation of it (see the module docstring); the number
    of modules bound. Raises ``UsageError`` naming ``--init-model-with-meta-device`` and the module where it
    cannot."""
    config = model.config
    if not config.use_cpu_initialization:  # set on CPU by transformer_config_from_args; on CUDA by the flag
        raise UsageError(f"{FLAG} on megatron-core's model needs --use-cpu-initialization on CUDA: without it "
                         "megatron-core allocates and initialises its tensor-parallel weights on the CUDA device "
                         "(_initialize_affine_weight_gpu), not on the meta device, and that initialisation is not "
                         "replayed here")
    if not config.perform_initialization:
        raise UsageError(f"{FLAG} with perform_initialization off: megatron-core leaves its weights uninitialised "
                         "memory, which no materialisation reproduces")
    parents: dict[int, nn.Module] = {id(child): parent for parent in model.modules() for child in parent.children()}
    bound = 0
    for fqn, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(True for child in module.children() for _ in child.parameters()):
            # eager builds a module's own parameters after its children's (e.g. the shared experts' gate, built
            # after the shared MLP's linears), materialize_meta before them: the generator's order would differ
            raise _unknown(fqn, module, "holds parameters of its own beside its children's, which its constructor "
                           "initialises after the children's")
        init = _initializer(fqn, module, parents.get(id(module)), config)
        if init is not None:
            module.reset_parameters = functools.partial(
                _in_model_dtype, module, dict(module.named_parameters(recurse=False)), init)
            bound += 1
    return bound


__all__ = ["FLAG", "bind_initializers"]

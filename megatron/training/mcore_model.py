"""megatron-core's ``GPTModel`` from Megatron-LM's flags: the model ``pretrain_gpt.py`` builds.

It is the only model, as in Megatron-LM (``--model-provider mcore``, the default; ``auto`` is
the same). Where megatron-core cannot run a configuration here (``mcore_blockers``: not
installed, another version without CUDA, an MoE activation it cannot fuse, TransformerEngine
asked for and absent), start-up stops with each cause and the flag to change
(``check_mcore_model``). On CPU, megatron-core runs through ``mcore_cpu_compat``.

The flags become a ``TransformerConfig`` as in Megatron-LM's
``core_transformer_config_from_args`` (every config field that has a flag of the same
name, then its explicit overrides), and the layer spec is Megatron's choice by
``--transformer-impl`` (``local``: megatron-core's own modules, with ``mcore_mla.py``'s core
attention for multi-latent attention and ``mcore_cp_attention.py``'s under context parallelism;
``transformer_engine``).
Flags this front-end does not define yet are read with Megatron's defaults.

Imported by the front-end without megatron-core; megatron-core is imported lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mcore_cpu_compat import MCORE_VERSION, apply_cpu_compat, cuda_absent

# Fusion switches whose kernels exist only on CUDA (apex / TransformerEngine / megatron's CUDA extensions):
# on CPU they are turned off, which changes no numbers of the fp32 path (the unfused code computes the same).
CPU_OFF_FUSIONS = ("masked_softmax_fusion", "gradient_accumulation_fusion", "apply_rope_fusion", "persist_layer_norm",
                   "moe_permute_fusion")


def _arg(args: argparse.Namespace, dest: str, default):
    """A flag by Megatron's ``dest``, with Megatron's default where this front-end does not define it."""
    return getattr(args, dest, default)


def _mcore_version() -> str | None:
    """megatron-core's version, or None where it cannot be imported (not installed, or blocked: an ImportError)."""
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return package_info.__version__


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def mcore_fallback_note() -> str | None:
    """The start-up summary's line for megatron-core's "Transformer Engine and Apex are not installed" warnings
    (filtered at import by ``megatron/training/__init__.py``), or None where megatron-core is not imported or
    either is installed."""
    if "megatron.core" not in sys.modules or _have_transformer_engine() or importlib.util.find_spec("apex"):
        return None
    return ("megatron-core: Transformer Engine and Apex are not installed; it uses its local implementations "
            "(torch optimizers and norms, unfused multi-tensor and clip-grad kernels)")


def _not_installed() -> str:
    """Why megatron-core is missing and how to get it (.ci/setup.sh installs it, pinned, in the venv)."""
    return (f"megatron-core is not installed (pip install megatron-core=={MCORE_VERSION}, or "
            "pip install -e '.[training]'; .ci/setup.sh installs it)")


def mcore_blockers(args: argparse.Namespace) -> list[str]:
    """Why megatron-core's GPTModel cannot run this configuration here (empty: it can)."""
    version = _mcore_version()
    if version is None:
        return [_not_installed()]
    blockers = []
    if cuda_absent() and version != MCORE_VERSION:
        blockers.append(f"megatron-core {version} is installed, and its CPU compatibility layer "
                        f"(megatron/training/mcore_cpu_compat.py) is written for {MCORE_VERSION}")
    if _arg(args, "transformer_impl", "local") == "transformer_engine" and not _have_transformer_engine():
        blockers.append("--transformer-impl transformer_engine needs TransformerEngine, which is not installed "
                        "(pass --transformer-impl local for megatron-core's own layers)")
    if args.num_experts:
        # megatron-core 0.16.1's experts (SequentialMLP's MLPs) add their output bias, scaled by the router's
        # per-token probabilities, in place on the output of the row-parallel reduce, a custom autograd function
        # that returns its input as-is: autograd refuses it at the first forward (mlp.py). Grouped GEMM (CUDA only)
        # runs other expert code.
        if _arg(args, "add_bias_linear", True) and (cuda_absent() or not _arg(args, "moe_grouped_gemm", False)):
            blockers.append("--num-experts with biases: megatron-core 0.16.1's experts add their output bias in "
                            "place on a view autograd refuses at the first forward (pass --disable-bias-linear)")
        # It fuses the bias-activation with the router's per-token probabilities only for SwiGLU: GeLU raises.
        if not args.swiglu and _arg(args, "bias_gelu_fusion", True):
            blockers.append("--num-experts with GeLU experts: megatron-core fuses the bias-GeLU only without the "
                            "router's per-token probabilities (pass --no-bias-gelu-fusion: the same numbers, unfused)")
    return blockers


def check_mcore_model(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """``fail`` with every blocker's message where megatron-core's GPTModel cannot run this configuration here."""
    blockers = mcore_blockers(args)
    if blockers:
        fail("megatron-core's GPTModel (the model pretrain_gpt.py builds) cannot run this here: "
             + "; ".join(blockers))


def transformer_config_from_args(args: argparse.Namespace):
    """Megatron-LM's ``core_transformer_config_from_args`` over this front-end's flags.

    Every ``TransformerConfig`` field with a flag of the same name takes the flag's
    value; then Megatron's explicit mappings (``--norm-epsilon``, ``--swiglu``,
    ``--group-query-attention`` ...). On CPU, ``use_cpu_initialization`` is on (the
    weights are built on the host, as Megatron's flag does) and the CUDA-only fusions
    of ``CPU_OFF_FUSIONS`` are off.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    config_class = MLATransformerConfig if _arg(args, "multi_latent_attention", False) else TransformerConfig
    names = {f.name for f in dataclasses.fields(config_class)}
    kw = {name: getattr(args, name) for name in names if hasattr(args, name)}
    params_dtype = torch.bfloat16 if args.bf16 else torch.float32  # args.params_dtype is its name here
    kw.update(
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        persist_layer_norm=not _arg(args, "no_persist_layer_norm", False),
        layernorm_epsilon=_arg(args, "layernorm_epsilon", 1e-5),  # --norm-epsilon's dest
        deallocate_pipeline_outputs=True,
        batch_p2p_comm=not _arg(args, "overlap_p2p_comm", False),
        num_moe_experts=args.num_experts,
        rotary_interleaved=_arg(args, "rotary_interleaved", False),
        fp8_param=_arg(args, "fp8_param_gather", False),
        # Megatron defines --no-gradient-accumulation-fusion (default on) and --no-masked-softmax-fusion.
        gradient_accumulation_fusion=_arg(args, "gradient_accumulation_fusion", True),
        masked_softmax_fusion=_arg(args, "masked_softmax_fusion", True),
        bias_dropout_fusion=_arg(args, "bias_dropout_fusion", True),
        apply_rope_fusion=_arg(args, "apply_rope_fusion", True),
        add_bias_linear=_arg(args, "add_bias_linear", True),
        inference_sampling_seed=args.seed,
        use_cpu_initialization=_arg(args, "use_cpu_initialization", False),
    )
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True,
                  bias_activation_fusion=_arg(args, "bias_swiglu_fusion", True))
    else:
        kw.update(bias_activation_fusion=_arg(args, "bias_gelu_fusion", True))
    if _arg(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
    # Megatron: --num-query-groups counts only with --group-query-attention.
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    cp_comm_type = kw.get("cp_comm_type")
    if isinstance(cp_comm_type, list) and len(cp_comm_type) == 1:  # Megatron's mapping: one type for every layer
        kw["cp_comm_type"] = cp_comm_type[0]
    balancing = kw.get("moe_router_load_balancing_type")
    if isinstance(balancing, list) and len(balancing) == 1:  # Megatron's validate_args: one type is a string
        kw["moe_router_load_balancing_type"] = balancing[0]
    if _arg(args, "rope_type", None) is None:
        kw.pop("rope_type", None)
    if cuda_absent():
        kw["use_cpu_initialization"] = True
        kw.update(dict.fromkeys(CPU_OFF_FUSIONS, False))
        kw["moe_grouped_gemm"] = False  # grouped_gemm / TransformerEngine are CUDA-only: one matmul per expert
        # The fused bias-activation and bias-dropout-add are TorchScript: they run on CPU, left as asked.
    kw["expert_tensor_parallel_size"] = _expert_tensor_parallel_size(args)
    kw["transformer_impl"] = _arg(args, "transformer_impl", "local")
    # megatron-core's default "full" is deprecated and warns on every rank ("Use empty cuda_graph_scope"), then
    # becomes []: pass [] as Megatron-LM's --cuda-graph-scope default does (the same config, no warning).
    kw.setdefault("cuda_graph_scope", [])
    return config_class(**{k: v for k, v in kw.items() if k in names})


def _layer_spec(args: argparse.Namespace, config):
    """Megatron-LM's layer-spec choice; under sequence parallelism without Apex the block spec with
    ``mcore_norm``'s torch norms that take it (megatron-core's torch-norm fallback refuses it); with context
    parallelism on the local spec, ``mcore_cp_attention``'s core attention (megatron-core's local one refuses CP)."""
    spec = _megatron_layer_spec(args, config)
    if config.context_parallel_size > 1 and config.transformer_impl == "local":
        from .mcore_cp_attention import with_context_parallel_core_attention

        spec = with_context_parallel_core_attention(spec)
    if (config.sequence_parallel and config.transformer_impl == "local"
            and importlib.util.find_spec("apex") is None):
        from .mcore_norm import with_sequence_parallel_norms

        spec = with_sequence_parallel_norms(spec, config.num_layers)
    return spec


def _megatron_layer_spec(args: argparse.Namespace, config):
    """Megatron-LM's layer-spec choice (gpt_builders.py): with --num-experts a block spec of dense and MoE layers
    by --moe-layer-freq, else one layer spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.num_experts:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=config.transformer_impl == "transformer_engine",
            normalization=args.normalization)
        if config.multi_latent_attention and config.transformer_impl == "local":  # as below, in every layer
            from .mcore_mla import with_mla_core_attention

            for layer_spec in block.layer_specs:
                with_mla_core_attention(layer_spec)
        return block

    common = dict(num_experts=args.num_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                  qk_layernorm=_arg(args, "qk_layernorm", False),
                  multi_latent_attention=_arg(args, "multi_latent_attention", False))
    if config.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**common)
    if common.pop("multi_latent_attention"):  # the local spec's core attention lacks MLA's head sizes: ours
        from .mcore_mla import mla_local_layer_spec

        return mla_local_layer_spec(**common, normalization=args.normalization)
    return gpt_layer_specs.get_gpt_layer_local_spec(**common, normalization=args.normalization)


def _expert_tensor_parallel_size(args: argparse.Namespace) -> int:
    """``--expert-tensor-parallel-size``, Megatron's default (None) being the TP size."""
    etp = _arg(args, "expert_tensor_parallel_size", None)
    return args.tensor_model_parallel_size if etp is None else etp


def initialize_mcore_parallel(args: argparse.Namespace, seed: int) -> None:
    """megatron-core's ``parallel_state`` (the job's process groups, Megatron's rank order) and RNG tracker.

    Megatron-LM does both in ``initialize_megatron``, which this front-end replaces:
    ``pretrain`` calls this before the model is built (parallel_state.build_layout derives
    the front-end's meshes from these groups). The tracker's "model-parallel-rng" state
    (seed + 2718 + TP rank) drives dropout inside TP regions; on CPU it is a CPU generator
    state (mcore_cpu_compat.py). Groups already laid out for the same sizes are kept.
    """
    from megatron.core import parallel_state, tensor_parallel

    if cuda_absent():
        apply_cpu_compat()
    tp, ep = args.tensor_model_parallel_size, getattr(args, "expert_model_parallel_size", 1)
    etp, cp = _expert_tensor_parallel_size(args), args.context_parallel_size
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_context_parallel_world_size() != cp
            or parallel_state.get_expert_model_parallel_world_size() != ep
            or parallel_state.get_expert_tensor_parallel_world_size() != etp
            or _instances() != instances):
        destroy_mcore_parallel()  # another job of this process laid out other groups
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, context_parallel_size=cp,
            expert_model_parallel_size=ep,
            # TP fastest, then CP, then DP (megatron-core's default order "tp-cp-ep-dp-pp", the front-end's mesh
            # (dp_outer?, dp_shard, cp, tp)); expert TP fastest, then EP (the expert mesh (dp_shard, ep, tp))
            expert_tensor_parallel_size=etp,
            num_distributed_optimizer_instances=instances,  # HSDP: dp_outer instances of dp_shard x cp ranks
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _instances() -> int:
    """The number of distributed-optimizer instances megatron-core's data-parallel groups were laid out for."""
    from megatron.core import parallel_state

    full = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return full // parallel_state.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)


def destroy_mcore_parallel() -> None:
    """megatron-core's ``destroy_model_parallel``, and the process groups it leaves alive.

    ``destroy_model_parallel`` only forgets its groups: each gloo group keeps its worker
    threads until ``dist.destroy_process_group``, so a process that lays out groups again
    (a second job, a test of another TP/CP size) kept about 50 threads per layout (1,700
    per rank after a test group's many layouts). Its groups are the ``ProcessGroup`` values
    of ``parallel_state``'s module globals, alone or in lists; WORLD is left alone, and so are
    the groups of the front-end's meshes (parallel_state.mesh_groups: about as many per layout as
    the front-end's own layout used to make): torch's DTensor dispatch caches match meshes by
    their ranks and names, so a later layout's DTensors could be redistributed over an earlier,
    equal mesh's groups.
    """
    from megatron.core import parallel_state

    groups: dict[int, dist.ProcessGroup] = {}
    for name, value in vars(parallel_state).items():
        if not name.startswith("_"):
            continue
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD:
                groups[id(group)] = group
    from .parallel_state import mesh_groups

    kept = mesh_groups()  # the front-end's meshes hold them: torch caches equal meshes over the same ranks
    parallel_state.destroy_model_parallel()
    for group in (g for key, g in groups.items() if key not in kept):
        try:
            dist.destroy_process_group(group)
        except ValueError:  # destroyed already (one group under two names), or not a group of this rank
            pass
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget torch's cached DTensor plans: they hold the meshes they were made for, and a mesh over the same
    ranks and names compares equal, so a later layout's DTensors would be redistributed over the destroyed
    groups of the front-end's earlier meshes (built from megatron-core's groups). Private torch caches: each is
    cleared where this torch has it."""
    import contextlib

    with contextlib.suppress(Exception):
        from torch.distributed.tensor import _redistribute

        _redistribute.clear_redistribute_planner_cache()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def mcore_gpt_model(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """megatron-core's GPTModel as Megatron-LM's ``gpt_builder`` makes it from the flags."""
    from megatron.core.models.gpt import GPTModel

    initialize_mcore_parallel(args, args.seed)
    config = transformer_config_from_args(args)
    model = GPTModel(
        config=config, transformer_layer_spec=_layer_spec(args, config), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=_arg(args, "rotary_percent", 1.0),
        rotary_base=args.rotary_base, rope_scaling=_arg(args, "use_rope_scaling", False),
    )
    if any(p.is_meta for p in model.parameters()):  # --init-model-with-meta-device: built under torch.device("meta")
        from .mcore_meta_init import bind_initializers

        bind_initializers(model)  # the engine's materialize_meta then gives each shard the eager build's values
    return model


def describe_mcore_model(config) -> str:
    """The start-up line's name of the model: megatron-core's GPTModel and its layer spec."""
    spec = "TransformerEngine" if config.transformer_impl == "transformer_engine" else "local"
    where = ", CPU compatibility layer" if cuda_absent() else ""
    return f"megatron-core GPTModel ({spec} layer spec{where})"

"""Mixture-of-Experts flags (Megatron-LM's names) and their validation.

``--num-experts E`` replaces every layer's MLP with an MoE layer of ``E`` experts
(megatron-core's ``MoELayer``: router options, shared experts, both dispatchers; ``mcore_model.py``);
``--expert-model-parallel-size P`` spreads them over
``P`` ranks and ``--expert-tensor-parallel-size T`` (default: the TP size)
splits each expert's linear layers over ``T`` (Megatron's layout: expert TP fastest, then EP), each
expert sharded over the ``world / (T x P)`` ranks of its expert data-parallel group. docs/moe.md.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .megatron_flags import DISPATCHER_TYPES, add_moe_compat_args


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: no MoE)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are spread over (consecutive ranks form an expert-parallel group)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size; default: "
                   "--ffn-hidden-size")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing auxiliary loss (0: none)")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHER_TYPES, default="allgather",
                   help="allgather (Megatron's default) and alltoall route the same; here tokens move to their "
                        "experts by all-to-all over the expert-parallel group; flex (DeepEP) is refused")
    add_moe_compat_args(g)


def validate_moe_args(args: argparse.Namespace, world_size: int, fail: Callable[[str], None]) -> None:
    """Reject what MoE cannot do here, naming the flags; derive ``expert_data_parallel_size``."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            fail(f"--expert-model-parallel-size {ep} needs --num-experts (there are no experts to spread)")
        args.expert_data_parallel_size = world_size
        return
    experts, topk = args.num_experts, args.moe_router_topk
    if experts < 1:
        fail(f"--num-experts must be positive, got {experts}")
    if not 1 <= topk <= experts:
        fail(f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})")
    if ep < 1 or world_size % ep:
        fail(f"--expert-model-parallel-size ({ep}) must be >= 1 and divide the world size ({world_size})")
    if world_size % (ep * args.expert_tensor_parallel_size):
        fail(f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size "
             f"({args.expert_tensor_parallel_size}) must divide the world size ({world_size})")
    if experts % ep:
        fail(f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep})")
    if args.moe_ffn_hidden_size is not None and args.moe_ffn_hidden_size <= 0:
        fail(f"--moe-ffn-hidden-size must be positive, got {args.moe_ffn_hidden_size}")
    if not (math.isfinite(args.moe_aux_loss_coeff) and args.moe_aux_loss_coeff >= 0):
        fail(f"--moe-aux-loss-coeff must be a finite number >= 0, got {args.moe_aux_loss_coeff}")
    tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
    if etp != tp and ep == 1:
        # megatron-core marks expert parameters allreduce=False (reduced over the expert data-parallel group)
        # only when expert_model_parallel_size > 1 (tensor_parallel/layers.py); at EP 1 they are reduced over the
        # dense data-parallel group, which is not the expert one when the expert TP size differs from TP's
        fail(f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size ({tp}) needs "
             "--expert-model-parallel-size > 1: megatron-core marks experts as expert parameters (reduced over "
             "the expert data-parallel group) only under expert parallelism, and the dense data-parallel group "
             "would reduce other slices or miss replicas")
    unsupported = (
        (tp > 1 and not args.sequence_parallel, "--tensor-model-parallel-size > 1 without "
         "--sequence-parallel (megatron-core's MoELayer trains under TP only with sequence parallelism)"),
        (args.context_parallel_size > 1, "--context-parallel-size > 1"),
    )
    for bad, what in unsupported:
        if bad:
            fail(f"--num-experts with {what} is not supported")
    if ep > 1:
        if not args.use_megatron_fsdp:
            fail("--expert-model-parallel-size > 1 needs --use-megatron-fsdp: DDP would average different experts "
                 "across the expert-parallel ranks")
    args.expert_data_parallel_size = world_size // (ep * etp)


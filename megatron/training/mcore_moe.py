"""What Megatron-LM's training loop does for megatron-core's MoE layers, done by this front-end's loop.

megatron-core's router attaches its load-balancing losses to the activations
(``MoEAuxLossAutoScaler``) and keeps their values in a module-level tracker; the
loop around it must

- set the auxiliary losses' backward scale before each micro-batch, as Megatron's
  ``schedules.forward_step`` does (``1 / num_microbatches``; with
  ``--calculate-per-token-loss`` the factor the summed lm loss gets, the router
  itself scaling by the local token count);
- after the gradient reduction, update the routers' expert bias
  (``--moe-router-enable-expert-bias``) from the tokens each expert received over
  the TP x DP ranks in this step, and reset those counts, as ``finalize_model_grads`` does;
- read the tracker once per iteration, as ``training_log`` does through
  ``track_moe_metrics`` (reduced over the ranks, scaled by ``1 / num_microbatches``,
  averaged over the MoE layers), for the log line's ``load_balancing_loss``.

megatron-core is imported lazily (only runs that built its MoE model get here).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class McoreMoE:
    """The MoE hooks of one megatron-core ``GPTModel`` (``for_model`` gives None for other models)."""

    def __init__(self, args: argparse.Namespace, module: nn.Module) -> None:
        from megatron.core.transformer.moe.router import Router

        self.args = args
        self.module = module
        self.config = module.config
        self.routers = [m for m in module.modules() if isinstance(m, Router)]
        # The tracker is megatron-core's module global: an earlier model of this process (another layer count)
        # must not leave its entries behind.
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()

    @classmethod
    def for_model(cls, args: argparse.Namespace, module: nn.Module) -> McoreMoE | None:
        if not getattr(args, "num_experts", None):
            return None
        return cls(args, module)

    def set_aux_loss_scale(self, scale: float, device: torch.device) -> None:
        """Every auxiliary loss of the next backward gets gradient ``scale`` (Megatron: loss scale / micro-batches)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=device))

    def finish_step(self) -> None:
        """``finalize_model_grads``' MoE part: the expert-bias update (tokens per expert all-reduced over
        TP x CP x DP), then its reset of the routers' per-step counters (tokens per expert, the global
        aux loss's token counts), so that each step's update sees only that step's tokens."""
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias,
            reset_model_temporary_tensors,
        )

        if self.config.moe_router_enable_expert_bias:
            _update_router_expert_bias([self.module], self.config)
        reset_model_temporary_tensors(self.config, [self.module])

    def losses(self, num_microbatches: int) -> dict[str, float]:
        """This iteration's tracked MoE losses (``load_balancing_loss`` ...), as Megatron's log line has them.

        Each is the tracker's per-layer sum over the micro-batches, reduced over the ranks by
        megatron-core (mean over data-parallel ranks), times ``1 / num_microbatches``, summed
        over layers and divided by the number of MoE layers; the tracker is then cleared.
        """
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

        names = sorted(get_moe_layer_wise_logging_tracker())
        if not names:
            return {}
        totals: dict[str, torch.Tensor] = {}
        track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0, total_loss_dict=totals, track_names=names,
                          num_layers=self.args.num_layers, moe_layer_freq=self.args.moe_layer_freq)
        return {name: float(value) for name, value in totals.items()}

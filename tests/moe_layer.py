"""A Mixture-of-Experts feed-forward layer in plain PyTorch, with expert parallelism: the model of the library's
expert-parallel tests (tests/distributed/parallel/moe_checks.py; the front-end trains megatron-core's MoE).

Megatron's defaults where it has them: a top-k router (top-k of the logits,
softmax over the chosen k), the switch-transformer load-balancing auxiliary loss
over the full softmax, token dispatch and combine by all-to-all over the
expert-parallel group (``expert_dispatch``), no capacity limit (no token is
dropped, so results do not depend on the EP size beyond rounding).

The auxiliary loss reaches the parameters as Megatron's ``MoEAuxLossAutoScaler``
makes it: the layer's output carries it, and backward adds
``aux_loss_scale * d(aux_loss)`` (set ``aux_loss_scale`` to 1 / micro-batches, as
Megatron's schedule does). The loss the model returns is the language-model loss.

Experts are ``ExpertMLP`` modules, one per local expert, whose parameters carry
Megatron's ``allreduce = False`` (what selects them for the expert data-parallel
mesh). By default every local expert runs on every step, on an empty batch when
no token reached it (its gradients are then zeros), as Megatron's SequentialMLP;
``skip_empty_experts=True`` runs only the experts that got tokens (the engine keeps
collectives in step when expert units run on some ranks only; docs/moe.md). Each
expert initialises itself from a generator seeded by (the process seed, its layer,
its global index): the weights of expert ``e`` are
the same whatever the EP size, and experts consume nothing of the global stream.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.expert_dispatch import ExpertParallel, combine, dispatch


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                        coeff: float) -> torch.Tensor:
    """Megatron's ``switch_load_balancing_loss_func``: ``E * coeff / (k * T^2) * sum_e(P_e * f_e)``.

    ``scores``: ``[T, E]`` full softmax; ``tokens_per_expert``: ``[E]`` assignments counted.
    """
    num_tokens, num_experts = scores.shape
    aggregated = scores.sum(dim=0)
    scale = num_experts * coeff / (topk * max(num_tokens, 1) * max(num_tokens, 1))
    return torch.sum(aggregated * tokens_per_expert.to(aggregated.dtype)) * scale


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` receives the gradient ``scale`` (Megatron's)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class TopKRouter(nn.Module):
    """Scores every expert for every token (fp32) and picks the top ``k``."""

    def __init__(self, hidden_size: int, num_experts: int, topk: int, std: float) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({num_experts})")
        self.topk, self.std = topk, std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> (probs ``[T, k]``, expert indices ``[T, k]``, full scores ``[T, E]``)."""
        logits = F.linear(x.float(), self.weight.float())
        top_logits, indices = torch.topk(logits, self.topk, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)
        return probs, indices, torch.softmax(logits, dim=-1)


class ExpertMLP(nn.Module):
    """One expert: ``fc2(act(fc1(x)))`` without biases (GeLU, or SwiGLU)."""

    def __init__(self, hidden_size: int, ffn_size: int, swiglu: bool, std: float, output_std: float,
                 seed_key: tuple[int, int]) -> None:
        super().__init__()
        self.swiglu, self.std, self.output_std, self.seed_key = swiglu, std, output_std, seed_key
        self.fc1_weight = nn.Parameter(torch.empty((2 if swiglu else 1) * ffn_size, hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_size))
        for param in self.parameters():
            param.allreduce = False  # Megatron's mark of an expert parameter
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.fc1_weight.device.type == "meta":
            return  # materialize_meta calls this again once the storage exists
        layer, expert = self.seed_key
        generator = torch.Generator().manual_seed(torch.initial_seed() * 1_000_003 + layer * 65_537 + expert)
        with torch.no_grad():
            for param, std in ((self.fc1_weight, self.std), (self.fc2_weight, self.output_std)):
                param.copy_(torch.randn(param.shape, generator=generator, device="cpu") * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.fc1_weight)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return F.linear(h, self.fc2_weight)


class MoELayer(nn.Module):
    """Router, dispatch, this rank's experts, combine; ``[batch, seq, hidden]`` in and out."""

    def __init__(self, hidden_size: int, num_experts: int, topk: int, ffn_size: int, *, swiglu: bool = False,
                 std: float = 0.02, output_std: float = 0.02, aux_loss_coeff: float = 0.0, layer_number: int = 0,
                 ep: ExpertParallel | None = None, skip_empty_experts: bool = False) -> None:
        super().__init__()
        self.skip_empty_experts = skip_empty_experts  # a local expert no token reached does not run
        self.ep = ExpertParallel.single() if ep is None else ep
        self.num_experts, self.topk, self.aux_loss_coeff = num_experts, topk, aux_loss_coeff
        self.aux_loss_scale = 1.0  # what backward multiplies the auxiliary loss by (1 / micro-batches)
        self.router = TopKRouter(hidden_size, num_experts, topk, std)
        self.local_experts = nn.ModuleList(
            ExpertMLP(hidden_size, ffn_size, swiglu, std, output_std, (layer_number, e))
            for e in self.ep.local_experts(num_experts)
        )
        self.last_aux_loss: torch.Tensor | None = None  # detached, for logging
        self.last_tokens_per_expert: torch.Tensor | None = None  # this rank's assignments (all experts)
        self.last_rows_per_local_expert: list[int] = []  # rows each local expert received (0: it did not run)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, indices, scores = self.router(tokens)
        tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        self.last_tokens_per_expert = tokens_per_expert
        grouped, plan = dispatch(tokens, indices, self.num_experts, self.ep)
        self.last_rows_per_local_expert = plan.expert_rows
        # Every local expert runs, also on no token (as Megatron's SequentialMLP), unless skip_empty_experts:
        # then an expert no token reached gets no gradient rather than a zero one (docs/moe.md).
        outputs = [expert(chunk) for expert, chunk in zip(self.local_experts, grouped.split(plan.expert_rows))
                   if chunk.shape[0] or not self.skip_empty_experts]
        expert_out = torch.cat(outputs) if outputs else grouped
        out = combine(expert_out, probs, plan, self.ep, tokens.shape[0]).to(x.dtype)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux = load_balancing_loss(scores, tokens_per_expert, self.topk, self.aux_loss_coeff)
            self.last_aux_loss = aux.detach()
            out = AuxLossAutoScaler.apply(out, aux, self.aux_loss_scale)
        return out.view(shape)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters Megatron marks as expert parameters (``allreduce = False``)."""
    return [p for p in module.parameters() if not getattr(p, "allreduce", True)]


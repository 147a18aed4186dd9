"""A GPT in plain PyTorch, configured by Megatron-LM's model flags; runs on CPU and CUDA.

Shaped like megatron-core's ``GPTModel`` where it matters to FSDP: an
embedding, a stack of ``TransformerLayer`` (the default FSDP unit), a final
norm and an output layer tied to the word embedding unless
``untie_embeddings_and_output_weights``.

Initialisation follows Megatron: every weight ~ N(0, init_method_std), the
two output projections of each layer (attention ``proj``, MLP ``fc2``) with
std / sqrt(2 * num_layers), biases zero, norms one. Parameters live only in
leaf modules (``MegatronLinear``, ``MegatronEmbedding``, norms) and each leaf
initialises itself in ``reset_parameters()``, so eager construction and
meta-device materialisation (pre-order ``reset_parameters``) consume the
random stream in the same order and give bitwise the same weights.

Tensor parallelism (``--tensor-model-parallel-size``, ``--sequence-parallel``) uses
Megatron's layers from ``megatron_fsdp.parallel``: QKV and FC1 column-parallel
(split by heads and by FFN width), the attention output projection and FC2
row-parallel, the word embedding and the output layer split by vocabulary, and the
loss computed on vocabulary-parallel logits. At TP size 1 each layer is the plain
one (the same arithmetic); at any size the initial weights are the slices of the
TP-1 model's (each layer draws the full weight and keeps its slice).

Dropout follows Megatron's RNG rules (rng_tracker.py, docs/megatron.md "Dropout and
random seeds"): at TP size > 1 attention dropout (each TP rank's own heads) draws from
the model-parallel RNG, seeded ``seed + 2718 + tp_rank``, and so, under sequence
parallelism, do the embedding and hidden dropouts (each TP rank's own tokens); without
sequence parallelism the embedding and hidden dropouts act on activations every TP rank
holds alike and draw from the default generator, the same on every rank.

Mixture of Experts (``--num-experts``): every layer's MLP is a ``MoELayer``
(``megatron_fsdp.parallel.moe``) whose experts are spread over the expert-parallel
group ``ep``; expert ``e`` has the same initial weights at any EP size (docs/moe.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fsdp.parallel import (
    ColumnParallelLinear,
    ContextParallel,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron_fsdp.parallel.context import causal_mask, gather_sequence
from megatron_fsdp.parallel.expert_dispatch import ExpertParallel
from megatron_fsdp.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_fsdp.parallel.moe import MoELayer

from .rng_tracker import tp_region_rng


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters (Megatron flag names, underscores for dashes)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    rotary_base: int = 10000
    layernorm_epsilon: float = 1e-5
    num_experts: int | None = None  # None: a dense MLP in every layer
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # default: ffn_size
    moe_aux_loss_coeff: float = 0.0
    kv_channels: int | None = None  # the head size; default hidden / heads (Megatron's --kv-channels)
    add_bias_linear: bool = True  # False: --disable-bias-linear
    qk_layernorm: bool = False  # a norm over each query and key head (--qk-layernorm)
    moe_layer_pattern: tuple[int, ...] | None = None  # 1: MoE layer, 0: dense (--moe-layer-freq); None: all MoE

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    def __post_init__(self) -> None:
        sizes = {"--num-layers": self.num_layers, "--hidden-size": self.hidden_size,
                 "--num-attention-heads": self.num_attention_heads, "--vocab-size (padded)": self.vocab_size,
                 "--max-position-embeddings": self.max_position_embeddings, "--ffn-hidden-size": self.ffn_size,
                 "--num-query-groups": self.query_groups}
        for flag, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        for flag, value in (("--attention-dropout", self.attention_dropout), ("--hidden-dropout", self.hidden_dropout)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        if not (math.isfinite(self.init_method_std) and self.init_method_std > 0):
            raise ValueError(f"--init-method-std must be a finite number > 0, got {self.init_method_std}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by --num-query-groups "
                f"({self.query_groups})"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"--position-embedding-type {self.position_embedding_type!r}: use learned_absolute, rope or none"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {self.normalization!r}: use LayerNorm or RMSNorm")
        if self.moe_layer_pattern is not None and len(self.moe_layer_pattern) != self.num_layers:
            raise ValueError(f"--moe-layer-freq lists {len(self.moe_layer_pattern)} layers, --num-layers is "
                             f"{self.num_layers}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError("--position-embedding-type rope needs an even head dimension")


class MegatronEmbedding(nn.Embedding):
    """``nn.Embedding`` with N(0, std) initialisation (the TP-replicated position embedding)."""

    def __init__(self, num_embeddings: int, dim: int, std: float) -> None:
        self.init_std = std
        super().__init__(num_embeddings, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


def _norm(config: GPTConfig, tp: TensorParallel, size: int | None = None) -> nn.Module:
    """A norm: TP-replicated; under sequence parallelism it sees part of the sequence on each TP rank.

    ``size``: a per-head norm (--qk-layernorm) over the head dimension, which every TP rank applies
    to whole heads: its gradient is complete on each rank, so not marked sequence-parallel.
    """
    width = config.hidden_size if size is None else size
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(width, eps=config.layernorm_epsilon)
    else:
        norm = nn.LayerNorm(width, eps=config.layernorm_epsilon)
    for param in norm.parameters():
        # its gradient is summed over TP (Megatron's attribute)
        param.sequence_parallel = tp.sequence_parallel and size is None
    return norm


def rotary_tables(seq_len: int, head_dim: int, base: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, head_dim] for rotary position embeddings (half-rotation layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, heads, seq, head_dim] by the position tables."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)


class SelfAttention(nn.Module):
    """Causal multi-head attention with grouped query heads (``num_query_groups``)."""

    def __init__(self, config: GPTConfig, output_std: float, tp: TensorParallel, cp: ContextParallel) -> None:
        super().__init__()
        self.cp, self.tp = cp, tp
        self.head_dim = config.head_dim
        self.heads = tp.divide(config.num_attention_heads, "--num-attention-heads")  # this TP rank's
        self.groups = tp.divide(config.query_groups, "--num-query-groups")
        self.dropout = config.attention_dropout
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.query_groups * self.head_dim
        self.qkv = ColumnParallelLinear(config.hidden_size, q_size + 2 * kv_size, config.init_method_std, tp,
                                        bias=config.add_bias_linear, segments=(q_size, kv_size, kv_size))
        self.q_norm = _norm(config, tp, self.head_dim) if config.qk_layernorm else None
        self.k_norm = _norm(config, tp, self.head_dim) if config.qk_layernorm else None
        self.proj = RowParallelLinear(q_size, config.hidden_size, output_std, tp, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: with context parallelism, which of the gathered keys each local query sees."""
        qkv = self.qkv(x)  # the whole sequence (gathered under sequence parallelism), this rank's heads
        batch, seq, _ = qkv.shape
        q, k, v = qkv.split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], dim=-1
        )
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.groups, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # Megatron's qk-layernorm: per head, before the rotary embedding
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k, v = gather_sequence(k, self.cp, dim=2), gather_sequence(v, self.cp, dim=2)  # every CP rank's keys
        if self.groups != self.heads:
            repeat = self.heads // self.groups
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout if self.training else 0.0
        with tp_region_rng(self.tp, active=dropout > 0):  # this TP rank's heads: its own masks (Megatron's fork)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Feed-forward block: GeLU, or SwiGLU with ``swiglu``."""

    def __init__(self, config: GPTConfig, output_std: float, tp: TensorParallel) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        tp.divide(config.ffn_size, "--ffn-hidden-size")
        width = 2 * config.ffn_size if config.swiglu else config.ffn_size
        segments = (config.ffn_size, config.ffn_size) if config.swiglu else None  # [gate | up], each split
        self.fc1 = ColumnParallelLinear(config.hidden_size, width, config.init_method_std, tp, segments=segments,
                                        bias=config.add_bias_linear)
        self.fc2 = RowParallelLinear(config.ffn_size, config.hidden_size, output_std, tp, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: the default FSDP unit (with MoE, its experts are units of their own)."""

    def __init__(self, config: GPTConfig, tp: TensorParallel, cp: ContextParallel,
                 ep: ExpertParallel | None = None, layer_number: int = 0) -> None:
        super().__init__()
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.input_norm = _norm(config, tp)
        self.attention = SelfAttention(config, output_std, tp, cp)
        self.pre_mlp_norm = _norm(config, tp)
        dense = config.moe_layer_pattern is not None and not config.moe_layer_pattern[layer_number]
        if config.num_experts is None or dense:
            self.mlp = MLP(config, output_std, tp)
        else:
            ffn = config.ffn_size if config.moe_ffn_hidden_size is None else config.moe_ffn_hidden_size
            self.mlp = MoELayer(config.hidden_size, config.num_experts, config.moe_router_topk, ffn,
                                swiglu=config.swiglu, std=config.init_method_std, output_std=output_std,
                                aux_loss_coeff=config.moe_aux_loss_coeff, layer_number=layer_number, ep=ep)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.tp = tp
        self.draws = config.hidden_dropout > 0 or config.attention_dropout > 0

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # Under sequence parallelism the residual stream is this TP rank's tokens: the whole layer draws from the
        # model-parallel RNG (megatron-core's TransformerBlock forks around its layers); otherwise the hidden
        # dropout acts on activations every TP rank holds alike and draws from the default generator.
        with tp_region_rng(self.tp, active=self.tp.sequence_parallel and self.training and self.draws):
            x = x + self.dropout(self.attention(self.input_norm(x), rotary, mask))
            return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))


class GPTModel(nn.Module):
    """Decoder-only language model; ``forward`` returns logits, or per-token losses given labels.

    ``tp``: the tensor-parallel group (default: none). Under sequence parallelism the
    residual stream between layers holds this TP rank's part of the sequence.
    ``cp``: the context-parallel group (default: none); ``forward`` then takes this CP
    rank's tokens (``ContextParallel.split`` of the sequence) and returns their losses.
    ``ep``: the expert-parallel group of MoE layers (default: every expert local).
    """

    def __init__(self, config: GPTConfig, tp: TensorParallel | None = None, cp: ContextParallel | None = None,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = TensorParallel.single() if tp is None else tp
        self.cp = cp = ContextParallel.single() if cp is None else cp
        std = config.init_method_std
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, std, tp)
        self.position_embeddings = (
            MegatronEmbedding(config.max_position_embeddings, config.hidden_size, std)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        if config.num_experts is not None and (tp.size > 1 or cp.size > 1):
            raise ValueError("--num-experts with tensor or context parallelism is not supported")
        self.layers = nn.ModuleList([TransformerLayer(config, tp, cp, ep, i) for i in range(config.num_layers)])
        self.final_norm = _norm(config, tp)
        self.output_layer = (
            ColumnParallelLinear(config.hidden_size, config.vocab_size, std, tp, bias=False)
            if config.untie_embeddings_and_output_weights
            else None
        )
        for param in self.word_embeddings.parameters():
            param.is_embedding_or_output_parameter = True
        if self.output_layer is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq = tokens.shape[1] * self.cp.size  # the whole sequence (this CP rank holds 1/C of it)
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq} exceeds --max-position-embeddings {self.config.max_position_embeddings}"
            )
        indices = self.cp.sequence_indices(seq, device=tokens.device)  # where this rank's tokens sit
        mask = causal_mask(self.cp, tokens.shape[1], tokens.device) if self.cp.size > 1 else None
        x = self.word_embeddings(tokens)
        rotary = None
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = indices.unsqueeze(0)
            x = x + self.position_embeddings(position_ids)
        elif self.config.position_embedding_type == "rope":
            cos, sin = rotary_tables(seq, self.config.head_dim, self.config.rotary_base, tokens.device)
            rotary = (cos, sin) if self.cp.size == 1 else (cos[indices], sin[indices])
        if self.tp.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp)
        # this TP rank's tokens under sequence parallelism: its own masks (megatron-core's embedding forks)
        sp_dropout = self.tp.sequence_parallel and self.training and self.config.hidden_dropout > 0
        with tp_region_rng(self.tp, active=sp_dropout):
            x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x, rotary, mask)
        x = self.final_norm(x)
        if self.output_layer is not None:
            logits = self.output_layer(x)  # this rank's vocabulary slice
        else:  # tied: the word embedding's slice, behind the same region a column-parallel layer has
            if self.tp.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.tp)
            else:
                x = copy_to_tensor_parallel_region(x, self.tp)
            logits = F.linear(x, self.word_embeddings.weight)
        if labels is None:
            return gather_from_tensor_parallel_region(logits, self.tp)
        return vocab_parallel_cross_entropy(logits.float(), labels, self.tp)

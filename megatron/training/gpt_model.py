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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by --num-query-groups "
                f"({self.query_groups})"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(
                f"--position-embedding-type {self.position_embedding_type!r}: use learned_absolute or rope"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {self.normalization!r}: use LayerNorm or RMSNorm")
        if self.position_embedding_type == "rope" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("--position-embedding-type rope needs an even head dimension")


class MegatronLinear(nn.Linear):
    """``nn.Linear`` initialised the Megatron way: N(0, std) weight, zero bias."""

    def __init__(self, in_features: int, out_features: int, std: float, bias: bool = True) -> None:
        self.init_std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class MegatronEmbedding(nn.Embedding):
    """``nn.Embedding`` with N(0, std) initialisation."""

    def __init__(self, num_embeddings: int, dim: int, std: float) -> None:
        self.init_std = std
        super().__init__(num_embeddings, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


def _norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


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

    def __init__(self, config: GPTConfig, output_std: float) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.groups = config.query_groups
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout = config.attention_dropout
        qkv_out = (self.heads + 2 * self.groups) * self.head_dim
        self.qkv = MegatronLinear(config.hidden_size, qkv_out, config.init_method_std)
        self.proj = MegatronLinear(config.hidden_size, config.hidden_size, output_std)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], dim=-1
        )
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.groups, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.groups != self.heads:
            repeat = self.heads // self.groups
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Feed-forward block: GeLU, or SwiGLU with ``swiglu``."""

    def __init__(self, config: GPTConfig, output_std: float) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        width = 2 * config.ffn_size if config.swiglu else config.ffn_size
        self.fc1 = MegatronLinear(config.hidden_size, width, config.init_method_std)
        self.fc2 = MegatronLinear(config.ffn_size, config.hidden_size, output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: the default FSDP unit."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.input_norm = _norm(config)
        self.attention = SelfAttention(config, output_std)
        self.pre_mlp_norm = _norm(config)
        self.mlp = MLP(config, output_std)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_norm(x), rotary))
        return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))


class GPTModel(nn.Module):
    """Decoder-only language model; ``forward`` returns logits, or per-token losses given labels."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        std = config.init_method_std
        self.word_embeddings = MegatronEmbedding(config.vocab_size, config.hidden_size, std)
        self.position_embeddings = (
            MegatronEmbedding(config.max_position_embeddings, config.hidden_size, std)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config.num_layers)])
        self.final_norm = _norm(config)
        self.output_layer = (
            MegatronLinear(config.hidden_size, config.vocab_size, std, bias=False)
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
        seq = tokens.shape[1]
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq} exceeds --max-position-embeddings {self.config.max_position_embeddings}"
            )
        x = self.word_embeddings(tokens)
        rotary = None
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0)
            x = x + self.position_embeddings(position_ids)
        else:
            head_dim = self.config.hidden_size // self.config.num_attention_heads
            rotary = rotary_tables(seq, head_dim, self.config.rotary_base, tokens.device)
        x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x, rotary)
        x = self.final_norm(x)
        weight = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        logits = F.linear(x, weight)
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return losses.view_as(labels)

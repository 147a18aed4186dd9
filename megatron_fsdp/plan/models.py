"""Model shapes the planner and the scale simulation know: units of named parameter shapes.

A model is a list of units in the order ``fully_shard`` would wrap them: every
decoder layer is one unit (``count`` identical ones), then the root, which owns
what no layer owns (embedding, final norm, output head). Only shapes: no
tensors, so a 70B model costs nothing to describe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitShape:
    """``count`` identical units, each holding ``params`` (name, shape) in registration order."""

    name: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    count: int = 1
    is_root: bool = False  # the outermost fully_shard: stays gathered between its forward and backward

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self.params]

    @property
    def numel(self) -> int:
        """Elements of one unit."""
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP, untied head)."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """One decoder layer's parameters, in the order ``simulate_scale``'s module registers them."""
        h, f, kv = self.hidden, self.ffn, self.kv_heads * self.head_dim
        return (
            ("input_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (h, h)),
            ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, h)),
            ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (f, h)),
            ("mlp.up_proj.weight", (f, h)),
            ("mlp.down_proj.weight", (h, f)),
        )

    def root_params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        h = self.hidden
        return (("embed_tokens.weight", (self.vocab, h)), ("norm.weight", (h,)), ("lm_head.weight", (self.vocab, h)))

    def units(self, layers: int | None = None) -> list[UnitShape]:
        """Decoder layers (``layers``, default all of them) then the root."""
        n = self.layers if layers is None else layers
        root = UnitShape("root", self.root_params(), 1, is_root=True)
        return [UnitShape("decoder layer", self.layer_params(), n), root]


@dataclass(frozen=True)
class MLPConfig:
    """``layers`` units of ``Linear(hidden, hidden)`` with bias: the small shape whose rows are large per shard."""

    name: str
    hidden: int
    layers: int

    def layer_params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return (("weight", (self.hidden, self.hidden)), ("bias", (self.hidden,)))

    def units(self, layers: int | None = None) -> list[UnitShape]:
        n = self.layers if layers is None else layers
        return [UnitShape("linear", self.layer_params(), n)]


MODELS: dict[str, LlamaConfig | MLPConfig] = {
    m.name: m
    for m in (
        LlamaConfig("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=32, vocab=128256),
        LlamaConfig("llama3-70b", hidden=8192, ffn=28672, heads=64, kv_heads=8, layers=80, vocab=128256),
        LlamaConfig("llama3-405b", hidden=16384, ffn=53248, heads=128, kv_heads=8, layers=126, vocab=128256),
        MLPConfig("mlp-1024", hidden=1024, layers=4),
        MLPConfig("mlp-4096", hidden=4096, layers=4),
    )
}


def model_named(name: str) -> LlamaConfig | MLPConfig:
    """The preset called ``name``; a ``ValueError`` lists the known ones."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]

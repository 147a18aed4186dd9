"""Multi-latent attention (``--multi-latent-attention``) with megatron-core's local layer spec, on CPU.

megatron-core's local spec gives MLA its plain ``DotProductAttention`` as core attention,
and MLA builds it with the query/key and value head sizes (``k_channels = qk_head_dim +
qk_pos_emb_head_dim``, ``v_channels = v_head_dim``), which ``DotProductAttention`` does not
take (``TypeError: unexpected keyword argument 'k_channels'``); only TransformerEngine's
attention does, and it needs CUDA. ``MLADotProductAttention`` is ``DotProductAttention``
with those two arguments: the same score matmul, scale, masked softmax and dropout (under
the RNG tracker), with the output width taken from the value head size. It is swapped into
megatron-core's own MLA spec (``mla_local_layer_spec``): a layer spec, not a patch.

Imported only where megatron-core is installed (``mcore_model._layer_spec``).
"""

from __future__ import annotations

import math

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` whose query/key head size (``k_channels``) and value head size (``v_channels``)
    may differ from ``kv_channels`` and from each other, as multi-latent attention needs.

    Queries and keys are ``[s, b, heads, k_channels]``, values ``[s, b, heads, v_channels]``;
    the output is ``[s, b, heads * v_channels]`` (this TP rank's heads). The scores are
    scaled by ``softmax_scale`` (MLA passes its yarn-corrected one), else ``1/sqrt(k_channels)``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
            if softmax_scale is None:  # DotProductAttention's default, from the query/key head size
                self.softmax_scale = 1.0 / math.sqrt(k_channels)
                if self.config.apply_query_key_layer_scaling:
                    self.softmax_scale /= self.layer_number
        if v_channels is not None:  # the context's width: heads x value head size
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


def with_mla_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a local MLA layer spec) with this core attention in place of ``DotProductAttention``."""
    spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return spec


def mla_local_layer_spec(**kwargs) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``multi_latent_attention=True`` and this core attention."""
    return with_mla_core_attention(gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True, **kwargs))


__all__ = ["MLADotProductAttention", "mla_local_layer_spec", "with_mla_core_attention"]

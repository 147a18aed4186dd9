"""Context parallelism (``--context-parallel-size`` > 1) for megatron-core's ``GPTModel`` with its local layer spec.

megatron-core 0.16.1 implements context parallelism only in TransformerEngine's
attention (``TEDotProductAttention``, CUDA); its local ``DotProductAttention`` asserts
``context_parallel_size == 1``. Everything else of megatron-core's model already handles
CP: its rotary embedding keeps this CP rank's positions (``get_pos_emb_on_this_cp_rank``),
the learned-absolute embedding reads the ``position_ids`` it is given (the loop gives this
rank's), and the rest of the layer works token by token. So the front-end supplies the
core attention, in megatron-core's layer spec (not a patch): ``ContextParallelDotProductAttention``.

What it computes, as Megatron does: the sequence of ``S`` tokens is cut into ``2 C``
chunks and CP rank ``r`` holds chunks ``r`` and ``2 C - 1 - r`` (Megatron's load-balanced
causal split, ``get_batch_on_this_cp_rank``). Each layer all-gathers the keys and values
of every CP rank over megatron-core's CP group (``parallel_state.get_context_parallel_group()``,
one all-gather of K and V together forward, one reduce-scatter of their gradients
backward: megatron-core's ``gather_from_sequence_parallel_region`` on the CP group), puts
them back in sequence order and masks each query by its global position: every query
sees exactly the keys it sees with the whole sequence on one rank, over the same row of
``S`` scores, so the softmax sums alike. Scores, scale (``softmax_scale``, or
``1/sqrt(head dim)``, with ``apply_query_key_layer_scaling``), megatron-core's
``FusedScaleMaskSoftmax`` (fp32 softmax for fp16/bf16 inputs as configured), GQA's key/value
expansion, attention dropout under megatron-core's RNG tracker (outside it under sequence
parallelism, as ``DotProductAttention``) and the context matmul are
``DotProductAttention``'s. Query/key and value head sizes may differ (``k_channels``,
``v_channels``: multi-latent attention).

Cost against Megatron's ring (TransformerEngine's ``p2p``, which overlaps each step's
exchange with the attention of the chunk already received): the all-gather moves the
same ``(C - 1)/C`` of the sequence's K and V per layer but without overlap, holds the whole
sequence's K and V on every rank, and computes scores for every query against all ``S``
keys (the masked half included) instead of skipping fully masked chunk pairs. megatron-core's
``cp_comm_type`` (Megatron-LM's ``--cp-comm-type``, a documented no-op here) is recorded and
does not change what is computed here.

Imported only where megatron-core is installed (``mcore_model._layer_spec``).
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import attention_mask_func, is_layer_window_attention
from megatron.core.utils import divide


def sequence_positions(full_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions in the whole sequence of CP rank ``cp_rank``'s tokens: chunks ``r`` and ``2 C - 1 - r`` of
    ``2 C`` (Megatron's load-balanced split; ``full_length`` must divide by ``2 C``)."""
    if full_length % (2 * cp_size):
        raise ValueError(f"sequence length {full_length} must be divisible by 2 x the context-parallel size "
                         f"({2 * cp_size}) for the load-balanced split")
    chunk = full_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


class ContextParallelDotProductAttention(MegatronModule):
    """megatron-core's ``DotProductAttention`` over a sequence split across the CP group (see the module's doc).

    Takes ``DotProductAttention``'s arguments (plus MLA's ``k_channels`` / ``v_channels``).
    ``forward(query, key, value, attention_mask)``: ``query`` ``[s/C, b, heads, k_channels]``,
    ``key`` ``[s/C, b, groups, k_channels]``, ``value`` ``[s/C, b, groups, v_channels]`` (this
    TP rank's heads, this CP rank's tokens), all in the order of this rank's two chunks; the
    result is ``[s/C, b, heads * v_channels]``. ``attention_mask`` None means causal; a given
    mask is this rank's query rows of the whole sequence's (``[b, 1, s/C, s]``, True =
    masked), as Megatron's CP data split leaves it.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # recorded: every type computes this same attention here (all-gather)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("sliding-window attention (--window-size) with --context-parallel-size > 1 "
                                      "on megatron-core's local layer spec is not implemented")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"--softmax-type {config.softmax_type} with --context-parallel-size > 1 on "
                                      "megatron-core's local layer spec is not implemented")
        tp_size = self.tp_group.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        head_dim = config.kv_channels if k_channels is None else k_channels
        value_dim = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_attention_head = head_dim
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value_dim
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        coeff = None
        if config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.softmax_scale /= coeff
        # An explicit mask every time (causal by global positions): the padding-type kernel applies any mask,
        # where the causal one assumes this rank's queries are the whole (square) sequence.
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=config.fp16, input_in_bf16=config.bf16, attn_mask_type=AttnMaskType.padding,
            scaled_masked_softmax_fusion=config.masked_softmax_fusion, mask_func=attention_mask_func,
            softmax_in_fp32=config.attention_softmax_in_fp32, scale=coeff)
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)
        self._masks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _order_and_mask(self, local_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered keys' sequence order (an index into the rank-major gather) and the causal mask
        ``[1, 1, local queries, S keys]`` (True where the key lies after the query), cached per length."""
        size, rank = self.cp_group.size(), self.cp_group.rank()
        key = (local_length, size, rank, str(device))
        if key not in self._masks:
            full = local_length * size
            gathered = torch.cat([sequence_positions(full, size, r, device) for r in range(size)])
            order = torch.argsort(gathered)  # gathered[order] == arange(full)
            queries = sequence_positions(full, size, rank, device)
            mask = torch.arange(full, device=device).unsqueeze(0) > queries.unsqueeze(1)
            self._masks[key] = (order, mask.view(1, 1, local_length, full))
        return self._masks[key]

    def _gather_keys_and_values(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every CP rank's keys and values in sequence order: one all-gather (forward) / reduce-scatter (backward)
        of both along the sequence, over the CP group."""
        head_dim = key.shape[-1]
        both = torch.cat([key, value], dim=-1)
        both = gather_from_sequence_parallel_region(both, True, group=self.cp_group)
        order, _ = self._order_and_mask(key.shape[0], key.device)
        both = both.index_select(0, order)
        return both[..., :head_dim], both[..., head_dim:]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence's keys (see the class's doc)."""
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (thd) with context parallelism need TransformerEngine")
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by DotProductAttention")
        local_length = query.shape[0]
        if self.cp_group.size() > 1:
            key, value = self._gather_keys_and_values(key, value)
        if attention_mask is None:
            attention_mask = self._order_and_mask(local_length, query.device)[1]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # GQA: [sk, b, ng, hn] -> [sk, b, np, hn]
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        b, heads, sq, sk = query.size(1), query.size(2), query.size(0), key.size(0)
        query = query.reshape(sq, b * heads, -1)
        key = key.reshape(sk, b * heads, -1)
        buffer = parallel_state.get_global_memory_buffer().get_tensor((b * heads, sq, sk), query.dtype, "mpu")
        scores = torch.baddbmm(buffer, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale).view(b, heads, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, None)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        value = value.reshape(sk, b * heads, -1)
        context = torch.bmm(probs.view(b * heads, sq, sk), value.transpose(0, 1))
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)


def with_context_parallel_core_attention(spec):
    """``spec`` (a layer spec, or a block spec of layer specs) with ``ContextParallelDotProductAttention`` as every
    layer's core attention (in place, also returned)."""
    for layer_spec in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer_spec.submodules.self_attention
        if isinstance(attention, ModuleSpec) and hasattr(attention.submodules, "core_attention"):
            attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec


__all__ = ["ContextParallelDotProductAttention", "sequence_positions", "with_context_parallel_core_attention"]

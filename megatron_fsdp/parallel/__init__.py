"""Model parallelism beside FSDP: Megatron-style tensor, sequence and context parallelism.

Owns the tensor-parallel regions (``mappings``: forward/backward pairs of
collectives as autograd functions, written once), the layers built on them
(``layers``: column- and row-parallel linears, the vocabulary-parallel
embedding), the vocabulary-parallel cross-entropy (``cross_entropy``), context
parallelism (``context``: the load-balanced sequence split and the exact attention
over every rank's keys), the gradient sums TP adds (``grads``) and the helpers that
lay out ranks and split initial weights (``tp_group``), and counts the bytes of its
collectives apart from the engine's (``comm_bytes.model_parallel_stats``). It may import
``comm`` (for ``CommStats``) and nothing else of ours: the FSDP engine knows nothing
of it; FSDP shards each tensor-parallel rank's slices over the data-parallel group
(see docs/parallelism.md).
"""

from megatron_fsdp.parallel.comm_bytes import model_parallel_stats
from megatron_fsdp.parallel.context import ContextParallel
from megatron_fsdp.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_fsdp.parallel.grads import allreduce_sequence_parallel_grads, params_for_grad_norm
from megatron_fsdp.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_fsdp.parallel.tp_group import TensorParallel, set_tensor_model_parallel_attributes

__all__ = [
    "ColumnParallelLinear",
    "ContextParallel",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "model_parallel_stats",
    "params_for_grad_norm",
    "set_tensor_model_parallel_attributes",
    "vocab_parallel_cross_entropy",
]

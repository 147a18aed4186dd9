"""What Megatron-style tensor parallelism adds around FSDP, for models whose layers megatron-core provides.

The TP layers themselves are megatron-core's (``megatron.core.tensor_parallel``) or torch's
DTensor TP (``parallelize_module``); the engine shards their slices by megatron-core's
``tensor_model_parallel``/``partition_dim`` attributes or DTensor placements (docs/parallelism.md).
What neither provides for a training loop over our sharded gradients is here:
``TensorParallel`` (a TP group's size, rank and whether sequence parallelism is on),
Megatron's parameter attributes and splitting of full weights (``tp_group``), the gradient
bookkeeping TP adds (``grads``: sequence-parallel gradient sums over TP, the parameters each
counted once in a global norm), and ``model_parallel_stats`` (``comm_bytes``: the bytes of these
collectives, apart from the engine's ``comm_stats``). It may import ``comm`` and nothing else of
ours; the FSDP engine does not import it.
"""

from megatron_fsdp.parallel.comm_bytes import model_parallel_stats
from megatron_fsdp.parallel.grads import allreduce_sequence_parallel_grads, params_for_grad_norm
from megatron_fsdp.parallel.tp_group import TensorParallel, set_tensor_model_parallel_attributes

__all__ = [
    "TensorParallel",
    "allreduce_sequence_parallel_grads",
    "model_parallel_stats",
    "params_for_grad_norm",
    "set_tensor_model_parallel_attributes",
]

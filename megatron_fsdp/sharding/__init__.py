"""sharding: what is split, over which ranks, and how a tensor's pieces are laid out.

Owns the strategy table (``STRATEGIES``: ``no_shard``, ``optim``, ``optim_grads``,
``optim_grads_params`` and their ``ShardingPlan``; the one place strategy names
are defined), device meshes and the HSDP outer dimension, the flat-shard layout
arithmetic, the ``RaggedShard`` DTensor placement, and ``fsdp_no_shard`` marks.
May import ``comm`` only; it knows nothing of units or modules.
"""

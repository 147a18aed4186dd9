"""api: the whole-model entry points built on the per-module engine.

Owns ``fully_shard_model`` (Megatron-FSDP's whole-model API and the one-line
``fully_shard(model, optimizer, ...)`` form), the ``MegatronFSDP`` wrapper that
Megatron's training loop drives, and ``DistributedDataParallelConfig``. May import
every other sub-package except ``mcore``; nothing below imports it. The public
``megatron_fsdp.fully_shard`` (per-module or whole-model, by its arguments) sits
above it, in ``megatron_fsdp/fully_shard.py``.
"""

"""optim: what an optimizer step needs from the engine.

Owns ``fully_shard_optimizer`` (an optimizer wrapped to sync gradients before and
install weights after ``step``, through ``core.steps``), stepping optimizers on
local shards, and gradient norms and clipping.
May import ``comm``, ``memory``, ``sharding`` and ``core``.
"""

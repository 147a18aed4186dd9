"""core: the per-module engine: units, their hooks, parameter groups and the root's schedule.

Owns ``FSDPUnit`` (one ``fully_shard``-ed module: forward/backward hooks, unshard
and reshard, gradient reduction), ``FSDPModule`` (the methods a sharded module
gains), ``ParamGroup`` (one flat buffer of parameters, its shard and its
collectives), ``RootState`` and the ``CollectiveSchedule`` all ranks agree on,
micro-batching, meta-device materialisation, the step guard, argument validation,
the mixed-precision policy and gradient scaling, ``shard_module`` (the per-module
``fully_shard``), ``steps`` (the per-step operations on units both wrappers call)
and ``lookup.units_of`` (the one way to find the units under a module).
May import ``comm``, ``memory`` and ``sharding``; never ``optim``, ``checkpoint``
or ``api``.
"""

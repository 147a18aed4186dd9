"""comm: the collectives the engine issues and how they are counted and profiled.

Owns the ``Pending`` work handles, the all-gather / reduce-scatter / all-reduce
wrappers with their side streams and gloo fast paths, ``comm_stats`` (bytes and
calls per collective) and the profiler range names. The bottom layer: it imports
nothing from ``megatron_fsdp`` (only torch).
"""

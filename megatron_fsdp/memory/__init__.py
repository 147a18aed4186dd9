"""memory: flat buffers and where their storage comes from.

Owns ``FlatBuffer`` (one contiguous tensor that parameters and gradients are views
of), the ``BufferPool`` that recycles unsharded weight and gradient storage between
units, and the spare gradient buffers reused across steps. The bottom layer: it
imports nothing from ``megatron_fsdp`` outside ``memory``.
"""

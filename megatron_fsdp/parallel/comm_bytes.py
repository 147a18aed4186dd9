"""Bytes of the model-parallel collectives (TP, SP, CP, EP), counted apart from the engine's.

The data-parallel engine records into ``megatron_fsdp.comm_stats``; every collective of
this sub-package records here instead, under ``<tp|cp|ep>_<collective>``, so that a
benchmark or test can hold FSDP's bytes to the ZeRO minimum of the model-parallel slice
and report what tensor, context and expert parallelism add on top.
"""

from __future__ import annotations

import torch

from megatron_fsdp.comm.collectives import CommStats

model_parallel_stats = CommStats()


def record(kind: str, tensor: torch.Tensor) -> None:
    """Count ``tensor``'s bytes under ``kind`` (the full, unsplit size, as the engine counts)."""
    model_parallel_stats.record(kind, tensor)

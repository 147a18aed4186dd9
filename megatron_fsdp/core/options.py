"""``EngineOptions``: the engine's tunables, one object per root, passed down from ``fully_shard``.

``fully_shard(module, options=EngineOptions(...))`` attaches the options to the unit it
makes; an enclosing ``fully_shard`` hands its own options down to the units under it,
so every unit of a root runs with the root's options (docs/design.md section 1,
"Where options live"). Nothing here is process-wide: two models in one process (a
teacher and a student, an EMA copy, a benchmark) can run with different options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

POOL_ENV = "MEGATRON_FSDP_BUFFER_POOL"


def _default_buffer_pool() -> bool:
    """The default of ``EngineOptions.buffer_pool``: on, unless ``MEGATRON_FSDP_BUFFER_POOL=0``.

    The variable only changes the default (read each time default options are built,
    never at import); an explicit ``buffer_pool=`` wins. It exists for soak runs of
    unmodified test suites with the pool off (``python -m tests.soak``).
    """
    return os.environ.get(POOL_ENV, "1") != "0"


@dataclass(frozen=True)
class EngineOptions:
    """Engine options of one root (and every unit under it); the defaults are the library's behaviour.

    Attributes:
        buffer_pool: borrow unsharded weights' memory from the process's ``BufferPool``
            (memory/allocator.py) instead of allocating it per use. Default on, or the
            ``MEGATRON_FSDP_BUFFER_POOL`` environment variable (``0``: off).
        gloo_fast_paths: on gloo (CPU), all-gather as one broadcast per rank, and
            reduce-scatter over 2 ranks as one exchange of halves (over more, a dying
            gradient buffer as an in-place all-reduce): bitwise the numbers of the plain
            collectives (comm/collectives.py).
        side_streams: on CUDA, issue all-gathers and reduce-scatters from their own streams.
        max_reduces_in_flight: gradient reductions left in flight while backward goes on
            (memory bound); 0 makes every reduction synchronous (Megatron's
            ``overlap_grad_reduce=False``).
        prefetch_depth: units whose all-gather starts while one computes (the initial
            value of ``set_prefetch_depth``; may differ per unit).
    """

    buffer_pool: bool = field(default_factory=_default_buffer_pool)
    gloo_fast_paths: bool = True
    side_streams: bool = True
    max_reduces_in_flight: int = 2
    prefetch_depth: int = 1

    def __post_init__(self) -> None:
        for name in ("buffer_pool", "gloo_fast_paths", "side_streams"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineOptions.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_reduces_in_flight", "prefetch_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EngineOptions.{name} must be a non-negative int, got {value!r}")


# Fields every unit under one root must agree on (prefetch depth is per unit).
ROOT_FIELDS = ("buffer_pool", "gloo_fast_paths", "side_streams", "max_reduces_in_flight")


def resolve_options(options: EngineOptions | None) -> EngineOptions:
    if options is None:
        return EngineOptions()
    if not isinstance(options, EngineOptions):
        raise TypeError(f"options must be a megatron_fsdp.EngineOptions, got {type(options).__name__}")
    return options


def differing_root_fields(a: EngineOptions, b: EngineOptions) -> list[str]:
    """The fields in ``ROOT_FIELDS`` where ``a`` and ``b`` differ, as ``name=<b's> here, <a's>``."""
    return [f"{name}={getattr(b, name)!r} here, {getattr(a, name)!r}" for name in ROOT_FIELDS
            if getattr(a, name) != getattr(b, name)]


__all__ = ["POOL_ENV", "ROOT_FIELDS", "EngineOptions", "differing_root_fields", "resolve_options"]

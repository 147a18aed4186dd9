"""Compare sharded tensors with full references shard by shard: one collective per comparison.

``DTensor.full_tensor()`` per parameter (and per gradient) is one all-gather each: a check that
compares a model with its reference after every step spent more time gathering than training
(13% of the heaviest checks' time). Every rank holds the whole reference, so each rank can
compare its own shard with the same slice of the reference instead; the shards cover every
element, so together the ranks compare what the full tensors would, at the same tolerance.

A rank that found a difference must not raise alone (the others would go on into the next
collective and wait there until the group's timeout): ``raise_if_any_rank`` gathers every
rank's findings once and raises the same error, naming the rank, on all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron_fsdp.comm.objects import all_gather_objects


def local_and_expected(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``actual``'s values on this rank and the same elements of the full ``expected``.

    A DTensor's local tensor and the slice of ``expected`` at its global offset (the placement's own
    shard sizes and offsets: ragged row counts, zero-row shards and HSDP's replicated dimension
    included); a plain tensor whole.
    """
    if not isinstance(actual, DTensor):
        return actual.detach(), expected.detach()
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"global shape {tuple(actual.shape)}, the reference has {tuple(expected.shape)}")
    shape, offset = compute_local_shape_and_global_offset(actual.shape, actual.device_mesh, actual.placements)
    local = actual.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise AssertionError(f"local shard of shape {tuple(local.shape)}, its placements say {tuple(shape)}")
    index = tuple(slice(start, start + size) for start, size in zip(offset, shape))
    return local, expected.detach()[index]


def shard_mismatch(actual: torch.Tensor, expected: torch.Tensor, compare: Callable[[torch.Tensor, torch.Tensor], None]
                   ) -> str | None:
    """What ``compare`` (e.g. ``torch.testing.assert_close`` with the check's tolerance) raised for this
    rank's shard of ``actual`` against ``expected``; None if it passed."""
    try:
        local, want = local_and_expected(actual, expected)
        compare(local, want)
    except AssertionError as exc:
        return str(exc)
    return None


def raise_if_any_rank(failures: list[str]) -> None:
    """Raise AssertionError on every rank if any rank's ``failures`` is non-empty (a collective)."""
    everyone = all_gather_objects(failures)
    found = [f"rank {rank}: {failure}" for rank, mine in enumerate(everyone) for failure in mine]
    if found:
        raise AssertionError("\n".join(found[:20]) + (f"\n... {len(found) - 20} more" if len(found) > 20 else ""))


def sharded_mismatches(triples: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
                       compare: Callable[[torch.Tensor, torch.Tensor], None]) -> list[str]:
    """``compare`` each ``(name, actual, expected)`` shard by shard; this rank's mismatches, each named."""
    failures = []
    for name, actual, expected in triples:
        found = shard_mismatch(actual, expected, compare)
        if found is not None:
            failures.append(f"{name}: {found}")
    return failures


def assert_sharded(triples: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
                   compare: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """``sharded_mismatches``, raised on every rank if any rank found one (a collective)."""
    raise_if_any_rank(sharded_mismatches(triples, compare))


def assert_close_sharded(pairs, what: str, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close(full(actual), expected, rtol, atol)`` for every ``(name, actual, expected)``
    of ``pairs``, compared shard by shard (see the module docstring); raises on every rank naming each one."""
    assert_sharded(((f"{what} {name}", actual, expected) for name, actual, expected in pairs),
                   lambda a, e: torch.testing.assert_close(a, e, rtol=rtol, atol=atol))

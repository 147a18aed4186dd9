"""``RaggedSpec``: the ``DTensorSpec`` of our sharded DTensors, never equal to a plain-``Shard`` spec.

``RaggedShard(0, sizes) == Shard(0)`` (``ragged_shard``'s docstring says why), and its
hash differs. That is enough for Python dicts, which compare hashes before ``==``, but
not for torch's C++ DTensor dispatch: its sharding-propagation cache
(``NativeShardingPropagatorCache``, per thread, keyed by the op and its input specs)
confirms a hit with the specs' ``==`` alone whenever two keys meet in one probe of its
hash table. Which keys meet depends on hash values that differ from process to process,
so now and then, on one rank only, an op on an FSDP2 parameter (``Shard(0)``, ``torch.chunk``
rows) was served the output spec cached for our parameter of the same shape
(``RaggedShard``, our rows), or the reverse. ``nn.Parameter(dtensor)`` detaches, so FSDP2's
parameters themselves came out labelled ``RaggedShard``; their DCP chunk metadata and
``full_tensor()`` then disagreed across ranks ("Received data size doesn't match
expected size" in ``get_model_state_dict(full_state_dict=True)``, DCP read-size
assertions: issue 25, item 2).

Every DTensor the library makes carries a ``RaggedSpec`` (``strict_spec``): equal only to
a spec with the same mesh, shape, stride, dtype and placements *of the same type and
sizes*. Python calls a subclass's ``__eq__`` first, on either side of ``==``, so the
cache can no longer take one for the other. Placement comparisons (``p.placements ==
q.placements``, what DTensor's in-place and redistribution checks use) are unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from megatron_fsdp.sharding.ragged_shard import RaggedShard


def _strict(placements: Sequence) -> tuple:
    return tuple((type(p), p) for p in placements)


class RaggedSpec(DTensorSpec):
    """A ``DTensorSpec`` whose ``==`` tells ``RaggedShard`` from ``Shard`` (module docstring)."""

    def __eq__(self, other: object, /) -> bool:
        if not isinstance(other, DTensorSpec):
            return False
        return _strict(self.placements) == _strict(other.placements) and DTensorSpec.__eq__(self, other)

    __hash__ = DTensorSpec.__hash__  # placements' hashes already include RaggedShard's sizes


def strict_spec(tensor: DTensor) -> DTensor:
    """Give ``tensor`` (in place) a ``RaggedSpec`` if one of its placements is a ``RaggedShard``; returns it."""
    spec = tensor._spec
    if type(spec) is DTensorSpec and any(isinstance(p, RaggedShard) for p in spec.placements):
        strict = copy.copy(spec)  # every field, the cached hash included
        strict.__class__ = RaggedSpec
        tensor._spec = strict
    return tensor

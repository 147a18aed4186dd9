"""``RaggedDTensor``: the DTensor type of our sharded parameters, gradients and what is derived from them.

PyTorch's sharding propagation writes a fresh ``Shard(d)`` on every output it computes
(``map_placements_after_broadcast``; only its own ``_StridedShard`` is carried over), so an
out-of-place op on a ``RaggedShard`` DTensor (``p.detach().clone()``, ``p * 2``,
``p.to(torch.bfloat16)``) came back labelled ``Shard(0)`` over ragged pieces, and
``full_tensor()``, DCP or ``redistribute`` of it were wrong or failed. And because
``RaggedShard(0) == Shard(0)`` (docs/design.md section 3), an op between our shard and an
even ``Shard(0)`` DTensor (``p.copy_(distribute_tensor(full, p.device_mesh, p.placements))``)
ran locally on pieces of different row counts and broadcast one into the other.

torch 2.13's DTensor supports subclasses that intercept ``__torch_dispatch__`` and delegate
back to DTensor (``DTensor.__torch_dispatch__``'s note). This one does, for every op that
touches a ragged DTensor (per index of the lists of a ``_foreach_*`` op):

1. *layout-free ops* (pointwise-tagged, ``_foreach_*``, copies, casts, ``*_like``, in-place
   random fills, ``sum``/norms) whose DTensor operands all have the ragged operand's shape
   (or are 0-dim): any operand whose placements are not exactly the ragged one's (an even
   ``Shard(0)`` from ``distribute_tensor``, a ``Replicate()`` tensor, another unit's ragged
   rows) is first redistributed into the ragged rows (through ``Replicate``), so the local op
   DTensor runs sees pieces of the same rows; a written operand is refused instead;
2. ``view``/``reshape`` keeping dim 0 of a tensor sharded only by ragged rows: a local view
   of our rows (DTensor would cut the local shape at ``torch.chunk`` boundaries); other views
   of one tensor go to DTensor as they are;
3. *anything else* (a matmul over the rows, a broadcast): DTensor sees the ragged operands
   gathered (``Replicate``), right for any op, at an all-gather; writing a ragged operand that
   way is refused, naming ``full_tensor()``;
4. *relabel*: an output ``Shard(d)`` whose pieces are the ragged operand's rows (global and
   local sizes along ``d`` those of the ragged dim) gets the ``RaggedShard`` back, and the
   output is a ``RaggedDTensor`` again, so clones, casts, EMA copies and optimizer state stay
   ragged through any chain of ops.

``redistribute`` to a plain ``Shard`` goes through ``Replicate`` (DTensor would see equal
placements and only relabel the ragged pieces).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Shard
from torch.utils._pytree import tree_flatten, tree_map

from megatron_fsdp.sharding.ragged_shard import RaggedShard
from megatron_fsdp.sharding.ragged_spec import strict_spec


def _strict(placements: Sequence) -> tuple:
    """Placements compared by type too (``RaggedShard(0, ...) == Shard(0)`` is ``True``)."""
    return tuple((type(p), p) for p in placements)


def _plain(tensor: DTensor, strip: bool = False) -> DTensor:
    """``tensor`` as a base-class DTensor over the same local tensor; ``strip``: its ``RaggedShard``s
    written as ``Shard`` (see ``__torch_dispatch__``)."""
    spec = tensor._spec
    if strip and has_ragged(spec.placements):
        placements = tuple(Shard(p.dim) if isinstance(p, RaggedShard) else p for p in spec.placements)
        spec = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
    return DTensor(tensor._local_tensor, spec, requires_grad=tensor.requires_grad)


def has_ragged(placements: Sequence) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def as_ragged(tensor: DTensor) -> DTensor:
    """``tensor`` as a ``RaggedDTensor`` (same local tensor and spec) when a placement is ragged."""
    if type(tensor) is RaggedDTensor or not has_ragged(tensor.placements):
        return tensor
    return strict_spec(RaggedDTensor(tensor._local_tensor, tensor._spec, requires_grad=tensor.requires_grad))


def _relaid(tensor: DTensor, like: DTensor) -> DTensor:
    """``tensor`` (same global shape as ``like``) in ``like``'s placements: gathered, then cut. Collective."""
    replicated = DTensor.redistribute(tensor, like.device_mesh, [Replicate()] * like.device_mesh.ndim)
    return DTensor.redistribute(_plain(replicated), like.device_mesh, like.placements)


def _relabelled(out: DTensor, ref: DTensor) -> DTensor:
    """``out`` with ``ref``'s ``RaggedShard`` where torch wrote a plain ``Shard`` over ``ref``'s rows."""
    placements = list(out.placements)
    changed = False
    for mesh_dim, (theirs, mine) in enumerate(zip(out.placements, ref.placements)):
        if type(theirs) is not Shard or not isinstance(mine, RaggedShard):
            continue
        d = theirs.dim
        if out.shape[d] == ref.shape[mine.dim] and out._local_tensor.size(d) == ref._local_tensor.size(mine.dim):
            placements[mesh_dim] = RaggedShard(d, mine.local_sizes, mine.order)
            changed = True
    if changed:
        spec = DTensorSpec(out.device_mesh, tuple(placements), tensor_meta=out._spec.tensor_meta)
        return strict_spec(RaggedDTensor(out._local_tensor, spec, requires_grad=out.requires_grad))
    return as_ragged(out)


def _written(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """``id``s of the tensors ``func`` writes to (``self`` of ``add_``, ``out=``, lists of ``_foreach_*_``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return set()
    ids = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        ids |= {id(t) for t in (value if isinstance(value, (list, tuple)) else [value])}
    return ids


# Ops DTensor runs on the local pieces whose result does not depend on where the pieces are
# cut, besides the pointwise-tagged ones (``clone``, ``mul``, ``lerp_``, ``addcdiv_`` ...):
# copies, casts, ``*_like`` factories, and reductions whose partial results DTensor combines
# (a sum or norm of ragged pieces is the sum or norm of the whole).
_LAYOUT_FREE = {
    "aten::_to_copy", "aten::copy_", "aten::detach", "aten::alias", "aten::fill_", "aten::zero_",
    "aten::zeros_like", "aten::ones_like", "aten::empty_like", "aten::full_like", "aten::rand_like",
    "aten::randn_like", "aten::sum", "aten::linalg_vector_norm", "aten::_foreach_norm", "aten::equal",
    "aten::_local_scalar_dense", "aten::_amp_foreach_non_finite_check_and_unscale_",
    # fused optimizers: element-wise over their lists, like _foreach_*
    "aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_",
}


# In-place random fills (``nn.init``): DTensor draws each piece at its global offset, which it
# takes from the placement (ours: the ragged rows).
_RANDOM = {"aten::uniform_", "aten::normal_", "aten::bernoulli_", "aten::random_", "aten::exponential_",
           "aten::geometric_", "aten::log_normal_", "aten::cauchy_"}


def _layout_free(func: Any) -> bool:
    name = func._schema.name if hasattr(func, "_schema") else ""
    return (name in _LAYOUT_FREE or name in _RANDOM or name.startswith("aten::_foreach_")
            or torch.Tag.pointwise in func.tags)


def _is_view(func: Any) -> bool:
    """An op whose output aliases its input without writing it (``view``, ``t``, ``detach``)."""
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def _groups(args: tuple, kwargs: dict) -> list[list[Any]]:
    """The operands that meet element by element: one group, or one per index of ``_foreach_*`` lists."""
    flat, _ = tree_flatten((args, kwargs))
    lists = [v for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple)) and v
             and all(isinstance(t, torch.Tensor) for t in v)]
    if not lists:
        return [flat]
    singles = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    return [[lst[i] for lst in lists if i < len(lst)] + singles for i in range(max(map(len, lists)))]


def _replicated(tensor: DTensor) -> DTensor:
    """``tensor`` with every ragged mesh dim gathered (a collective)."""
    placements = [Replicate() if isinstance(p, RaggedShard) else p for p in tensor.placements]
    return DTensor.redistribute(tensor, tensor.device_mesh, placements)


def name_of(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else ""


# DTensor cuts a view's local shape at torch.chunk boundaries; ours are not.
_RESHAPES = {"aten::view", "aten::_unsafe_view", "aten::reshape"}


def _only_ragged_rows(tensor: DTensor) -> bool:
    """Sharded by ``RaggedShard(0)`` only (no tensor-parallel ``Shard`` besides)."""
    return all(isinstance(p, Replicate) or (isinstance(p, RaggedShard) and p.dim == 0) for p in tensor.placements)


def _reshaped(tensor: DTensor, size: Sequence[int]) -> DTensor:
    """``tensor.view(size)`` for a tensor sharded only by ``RaggedShard(0)``, keeping dim 0 (a view of our rows)."""
    size = list(size)
    if -1 in size:
        known = math.prod(n for n in size if n != -1)
        size[size.index(-1)] = tensor.numel() // known if known else 0
    placements = tensor.placements
    if not size or size[0] != tensor.shape[0]:
        raise NotImplementedError(
            f"view/reshape of a DTensor with {placements} (megatron_fsdp's ragged rows) from {tuple(tensor.shape)} "
            f"to {tuple(size)}: only views that keep dim 0 are supported; take t.full_tensor() first")
    local = tensor._local_tensor.view([tensor._local_tensor.size(0), *size[1:]])
    meta = TensorMeta(torch.Size(size), torch.empty(size, device="meta").stride(), tensor.dtype)
    return strict_spec(RaggedDTensor(local, DTensorSpec(tensor.device_mesh, placements, tensor_meta=meta),
                                     requires_grad=local.requires_grad))


class RaggedDTensor(DTensor):
    """A DTensor with a ``RaggedShard`` placement that keeps it through the ops users apply.

    See the module docstring. ``isinstance(t, DTensor)`` holds; everything else about it is a
    DTensor's (``to_local``, ``placements``, ``full_tensor``, DCP, pickling).
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        swap: dict[int, DTensor] = {}  # id(operand) -> what DTensor computes with instead
        refs: dict[int, DTensor] = {}  # id(operand) -> the ragged operand its group follows
        local = _layout_free(func)
        view = _is_view(func)
        for group in _groups(args, kwargs):
            tensors = [t for t in group if isinstance(t, DTensor)]
            ragged = [t for t in tensors if isinstance(t, RaggedDTensor)]
            if not ragged:
                continue
            ref = ragged[0]
            if local and all(t.shape == ref.shape or t.dim() == 0 for t in tensors):
                for t in tensors:
                    refs[id(t)] = ref
                    if (t.dim() and t.device_mesh == ref.device_mesh
                            and _strict(t.placements) != _strict(ref.placements)):
                        if id(t) in written:
                            raise RuntimeError(
                                f"{func}: writes a DTensor with placements {t.placements} from one with "
                                f"{ref.placements} (megatron_fsdp's ragged rows); redistribute the "
                                "target to the source's placements first")
                        swap[id(t)] = _relaid(t, ref)
                continue
            if name_of(func) in _RESHAPES and len(tensors) == 1 and _only_ragged_rows(ref):
                return _reshaped(ref, args[1])
            if view and len(tensors) == 1:
                # A view of one ragged tensor: DTensor keeps the shard (a view of our rows, so
                # writes through it land: nn.init.orthogonal_'s view_as(q).copy_(q)) or
                # gathers it with our placement's hooks; either way nothing else is cut.
                refs[id(ref)] = ref
                continue
            # Anything else (a matmul over the ragged dim, a broadcast):
            # DTensor would cut the other operands at torch.chunk boundaries; it sees the
            # ragged operands gathered instead, which is right for any op, at an all-gather.
            for t in ragged:
                if id(t) in written:
                    raise NotImplementedError(
                        f"{func} on a DTensor with {t.placements} (megatron_fsdp's ragged rows) writes it "
                        "in a way that depends on where the rows are cut; apply it to "
                        "t.full_tensor() (or t.redistribute(placements=[Replicate()])) instead")
                swap[id(t)] = _replicated(t)

        originals: dict[int, DTensor] = {}
        # A layout-free op runs on local pieces whatever the cut, so DTensor is shown plain
        # ``Shard``s: its sharding-propagation cache matches placements with ``==``
        # (``RaggedShard == Shard``), and an in-place op served a result cached for ours would
        # give another library's ``Shard(0)`` DTensor (FSDP2's, same shape, equal mesh) our
        # ragged placement. Random fills keep it: DTensor draws each piece at the global offset
        # the placement gives, and plain ``Shard`` offsets of ragged pieces would overlap.
        strip = local and name_of(func) not in _RANDOM

        def unwrap(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            new = swap.get(id(t), t)
            if type(new) is not DTensor or (strip and has_ragged(new.placements)):
                new = _plain(new, strip)
                if new is not t and id(t) not in swap:
                    originals[id(new)] = t
            return new

        new_args, new_kwargs = tree_map(unwrap, (args, kwargs))
        out = func(*new_args, **new_kwargs)
        out_groups = _groups((out,), {}) if isinstance(out, (list, tuple)) else [[out]]
        in_groups = _groups(args, kwargs)

        def ref_of(index: int) -> DTensor | None:
            group = in_groups[index] if index < len(in_groups) else in_groups[0]
            return next((refs[id(t)] for t in group if refs.get(id(t)) is not None), None)

        def back(x: Any, ref: DTensor | None) -> Any:
            if id(x) in originals:  # an in-place op returns its (unwrapped) self
                return originals[id(x)]
            if isinstance(x, DTensor):
                return _relabelled(x, ref) if ref is not None else x
            return x

        if isinstance(out, (list, tuple)) and len(out_groups) == len(in_groups) > 1:  # _foreach_*: by index
            return type(out)(back(x, ref_of(i)) for i, x in enumerate(out))
        ref = ref_of(0)
        return tree_map(lambda x: back(x, ref), out)

    def redistribute(self, device_mesh=None, placements=None, *args: Any, **kwargs: Any) -> DTensor:  # type: ignore[override]
        """DTensor's ``redistribute``; to a plain ``Shard`` where this one is ragged, through ``Replicate``."""
        if placements is not None:
            placements = tuple(placements)
            via = [Replicate() if isinstance(mine, RaggedShard) and type(theirs) is not RaggedShard
                   and isinstance(theirs, Shard) else mine
                   for mine, theirs in zip(self.placements, placements)]
            if _strict(via) != _strict(self.placements):
                step = DTensor.redistribute(self, device_mesh, via, *args, **kwargs)
                return DTensor.redistribute(step, device_mesh, placements, *args, **kwargs)
        return as_ragged(DTensor.redistribute(self, device_mesh, placements, *args, **kwargs))

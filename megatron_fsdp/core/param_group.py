"""ParamGroup: one unit's parameters that share dtype and requires_grad.

A group owns three pieces of storage (docs/design.md section 2):

- ``shard``: this rank's slice of the flat buffer (main weights). The sharded
  parameters the optimizer sees are DTensor views of it.
- ``unsharded``: the whole flat buffer, filled by one all-gather of ``shard``;
  the parameters the module computes with are views of it (no copy-in, no
  copy-out). When the group is not sharded (one shard) it is ``shard`` itself.
- ``grad_buffer``: the whole flat gradient buffer, made when the group's gradients
  are reduced (or kept across backwards without a reduction). Reduced by one
  reduce-scatter (or all-reduce) straight into the sharded gradients. Until then a
  backward's gradients stay the tensors autograd made (``_stash``), as in FSDP2, unless a
  fused kernel asked for ``main_grad`` (``get_main_grad()``, see ``contribution``).

Which of these are sharded is decided by the ``ShardingPlan``; the group only
reads its three flags.

Two FSDP2 options change where storage lives. CPU offload (``core/offload.py``): the
shard and the sharded gradients live on the host; each all-gather sends a fresh
device upload of the shard, and each reduced gradient shard is downloaded before it
is installed. ``reshard_after_forward=N`` (``core/post_forward_shard.py``): a forward
gather also stores this rank's 1/N piece of the gathered buffer, and gathers until
the end of the backward run within a sub-group of N ranks from that piece.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_fsdp.comm.collectives import (
    DEFAULT_COMM,
    OUTER_STREAM,
    REDUCE_STREAM,
    CommConfig,
    Pending,
    all_gather,
    all_reduce,
    reduce_scatter,
)
from megatron_fsdp.core.grad_scaling import GradScaling
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.offload import download, host_empty, upload
from megatron_fsdp.core.post_forward_shard import PostForwardMesh
from megatron_fsdp.memory.allocator import BufferPool
from megatron_fsdp.memory.buffer import FlatBuffer
from megatron_fsdp.memory.grad_buffers import GradSpares
from megatron_fsdp.sharding.layout import FlatLayout, alignment_numel, build_flat_layout
from megatron_fsdp.sharding.mesh import DataParallelMesh
from megatron_fsdp.sharding.outer_shard import gather_compute_shard, outer_shard_geometry
from megatron_fsdp.sharding.ragged_dtensor import as_ragged
from megatron_fsdp.sharding.ragged_shard import RaggedShard, full_tensor, shard_sizes, without_storage_offset
from megatron_fsdp.sharding.ragged_spec import strict_spec
from megatron_fsdp.sharding.strategy import ShardingPlan
from megatron_fsdp.sharding.tensor_parallel import TensorParallelSpec, sharded_mesh

# Per-object gradient bookkeeping set by the engine on its own parameters: never carried to another one.
_SKIPPED_ATTRS = {"_is_param", "main_grad", "grad_added_to_main_grad", "get_main_grad", "__fsdp_param__"}


@dataclass
class ParamRef:
    """An original parameter and every (module, attribute) that registers it."""

    param: nn.Parameter
    uses: list[tuple[nn.Module, str]] = field(default_factory=list)
    fqns: list[str] = field(default_factory=list)  # one per use, relative to the unit's module
    replicated: bool = False  # marked fsdp_no_shard (or 0-dim): never sharded
    tp: TensorParallelSpec | None = None  # torch-native TP: the flat buffer holds the TP-local tensor

    @property
    def fqn(self) -> str:
        """The name of the first use, for messages."""
        return self.fqns[0]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape the flat buffer holds: the TP-local one under tensor parallelism."""
        return self.tp.local_shape if self.tp is not None else tuple(self.param.shape)


class GroupState(enum.Enum):
    SHARDED = "sharded"  # modules hold the sharded DTensor parameters
    UNSHARDED = "unsharded"  # modules hold views of the gathered flat buffer


@dataclass
class PendingReduce:
    """A gradient reduction in flight and where its result lands."""

    group: ParamGroup
    work: Pending
    output: torch.Tensor  # this rank's reduced shard, flat
    scratch: torch.Tensor | None = None  # the full gradient buffer, reusable once this lands
    # Only zeros went in from here: install the result only if another rank had
    # gradients (decided by the root at the end of backward, see core/schedule.py).
    defer_install: bool = False
    result: torch.Tensor | None = None  # the reduced main-shard part, once finished
    _outer: tuple[Pending, torch.Tensor] | None = None  # HSDP: the reduction across dp_outer
    # On side streams (CUDA) the outer stage is issued at once, chained on its own stream
    # behind the inner one with events (FSDP2's all_reduce_stream); the consumer waits for
    # it at the drain only (end of backward, before the optimizer), see ``finish_inner``.
    chained: bool = False

    def chain_outer(self) -> None:
        """Issue the outer (dp_outer) stage now, ordered after the inner one on the device, not the host."""
        self._outer = self.group.start_outer_reduction(self.output, after=self.work)
        self.chained = True

    def finish_inner(self) -> None:
        """Wait for the inner reduction only: its input (``scratch``) may be reused; the outer stage runs on."""
        self.work.wait()

    def finish(self) -> None:
        """Wait for the reduction (and its outer stage) and install the gradients."""
        self._advance(block=True)

    def poll(self) -> bool:
        """Advance as far as landed collectives allow, without waiting; True once finished.

        Chained: True once the inner stage landed, waiting for nothing (the outer stage is
        waited for at the drain).
        """
        if self.chained:
            return self.work.landed
        return self._advance(block=False)

    def _advance(self, block: bool) -> bool:
        if self.result is not None:
            return True
        if self._outer is None:
            if not block and not self.work.landed:
                return False
            self.work.wait()
            self._outer = self.group.start_outer_reduction(self.output)
        work, reduced = self._outer
        if not block and not (work.landed and self.work.landed):
            return False
        self.work.wait()  # chained: the inner stage was not waited for yet (no-op otherwise)
        work.wait()
        self.result = reduced
        if not self.defer_install and reduced is not None:  # None: held back (set_requires_all_reduce(False))
            self.group.install_grads(reduced)
        return True


def flat_alignment(dtype: torch.dtype, policy: MixedPrecisionPolicy | None) -> int:
    """The layout's ``align`` for parameters of ``dtype``: 16 bytes in the narrowest dtype their group
    holds a flat buffer in (main, compute, gradient, communication; ``layout.alignment_numel``)."""
    policy = policy or MixedPrecisionPolicy(main_params_dtype=None)
    return alignment_numel(d.itemsize for d in policy.dtypes_for(dtype))


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry attributes training loops rely on (``sequence_parallel``, ...) to ``dst``."""
    for name, value in vars(src).items():
        if name not in _SKIPPED_ATTRS and not name.startswith("_megatron_fsdp"):
            setattr(dst, name, value)


class ParamGroup:
    """Flat storage, sharded and unsharded parameters, and collectives for one group."""

    def __init__(
        self,
        refs: list[ParamRef],
        dp: DataParallelMesh,
        plan: ShardingPlan,
        device: torch.device,
        on_grads_ready: Callable[[ParamGroup], None],
        policy: MixedPrecisionPolicy | None = None,
        *,
        comm: CommConfig = DEFAULT_COMM,
        pool: BufferPool | None = None,
        spares: GradSpares | None = None,
        offload: CPUOffloadPolicy | None = None,
        post_forward: PostForwardMesh | None = None,
    ) -> None:
        self.refs = refs
        self.device = device  # where the module computes: gathered weights, gradient buffers, collectives
        self.offload = offload  # CPU offload: the shard and sharded gradients live on the host
        self.post_forward = post_forward  # reshard_after_forward=N: the sub-group of the post-forward shard
        self.post_forward_piece: torch.Tensor | None = None  # this rank's 1/N of the gathered weights
        self.keep_post_forward = False  # set by the root for the forward (grad enabled): store pieces
        self.uploads = 0  # host -> device copies of the shard (CPU offload), for tests and accounting
        self.downloads = 0  # device -> host copies of reduced gradients (CPU offload)
        self.comm = comm  # the root's: how its collectives run and where they are counted (``use``)
        self.spares = GradSpares() if spares is None else spares  # the root's (``use``)
        self.dp = dp
        self.plan = plan
        self.process_group: dist.ProcessGroup = dp.shard_group
        # HSDP outer 'optim': the main shard is one of dp_shard x dp_outer pieces (see outer_shard).
        self.outer = outer_shard_geometry(dp) if plan.optim and dp.outer_optim and dp.outer_size > 1 else None
        if self.outer is not None:
            self.shard_world, self.shard_rank = self.outer.pieces, self.outer.piece
        else:
            self.shard_world = dp.shard_size if plan.optim else 1
            self.shard_rank = dp.shard_rank if plan.optim else 0
        first = refs[0].param
        policy = policy or MixedPrecisionPolicy(main_params_dtype=None)
        self.compute_dtype, self.dtype, self.grad_dtype, self.comm_dtype = policy.dtypes_for(first.dtype)
        self.layout: FlatLayout = build_flat_layout(
            [r.local_shape for r in refs], self.shard_world, flat_alignment(first.dtype, policy))
        # Torch-native TP: the sharded parameters live on a (tp, dp) mesh (sharding/tensor_parallel.py).
        self._tp_meshes = {i: sharded_mesh(r.tp, dp) for i, r in enumerate(refs) if r.tp is not None}
        self._on_grads_ready = on_grads_ready

        if offload is not None:
            self.shard = host_empty(self.layout.shard_numel, self.dtype, offload).zero_()
        else:
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        self.gathers = plan.optim and dp.shard_size > 1
        # Meta-device parameters are filled later by init.materialize_meta.
        self.needs_init = first.device.type == "meta"
        if not self.needs_init:
            self._fill_shard_from(refs)
        for ref in refs:  # lets an enclosing fully_shard spot a parameter shared across units
            ref.param._megatron_fsdp_managed = True
        # Compute weights: the main shard itself, or a lower-precision copy of it
        # refreshed once per optimizer step (what the all-gather moves). Under
        # outer 'optim' it is the dp_shard-sized shard, gathered across dp_outer.
        # Under CPU offload a gathering group has no compute shard (each gather uploads the
        # host shard); a group that does not gather keeps a device copy, refreshed per step.
        self.compute_shard: torch.Tensor | None
        if self.outer is not None:
            numel = self.layout.shard_numel * self.outer.outer_size
            self.compute_shard = torch.zeros(numel, dtype=self.compute_dtype, device=device)
        elif offload is not None:
            self.compute_shard = None if self.gathers else torch.zeros(
                self.layout.shard_numel, dtype=self.compute_dtype, device=device)
        else:
            self.compute_shard = (
                self.shard if self.compute_dtype == self.dtype else self.shard.to(self.compute_dtype)
            )
        self.compute_stale = (
            self.needs_init or self.outer is not None or offload is not None
        ) and self.compute_shard is not None and self.compute_shard is not self.shard
        self.refreshes = 0  # main -> compute copies (outer 'optim': all-gathers), for tests and accounting
        self._outer_refresh: Pending | None = None  # issued at the root's forward, chained by our all-gather
        self.unsharded = (
            FlatBuffer(self.layout.total_numel, self.compute_dtype, device, allocated=True, pool=pool)
            if self.gathers
            else None
        )
        # Trainable parameters (gradient hooks, views into the grad buffer). Follows the
        # sharded parameters' requires_grad at every forward (follow_requires_grad).
        self._grad_indices = {i for i, r in enumerate(refs) if r.param.requires_grad}
        self._hooked: set[int] = set()  # unsharded parameters with a post-accumulate-grad hook
        self.sharded_params = [self._make_sharded_param(i) for i in range(len(refs))]
        self.unsharded_params = [self._make_unsharded_param(i) for i in range(len(refs))]
        if self.unsharded is not None:
            self.unsharded.free()  # views were taken while allocated; they survive this
        self.state = GroupState.SHARDED
        self._gather: Pending | None = None
        self._install(self.sharded_params, check=False)

        for ref in refs:
            # Keep only the metadata of the originals (global shape under TP), so their storage can be freed.
            meta = torch.empty(tuple(ref.param.shape), dtype=ref.param.dtype, device="meta")
            ref.param = nn.Parameter(meta, ref.param.requires_grad)

        # Gradients not reduced yet live in three places (docs/design.md, "Gradients"):
        # - _stash: this backward's gradients as autograd made them, by parameter index, copied
        #   into a flat buffer only when reduced: no full-size buffer (nor zero-filling) for the
        #   whole backward, which for a tied embedding (whose gradient comes last) is all of it;
        # - contribution: the flat buffer behind main_grad, made zeroed by get_main_grad() for
        #   fused wgrad kernels, which write it (Megatron-LM overwrites, TransformerEngine adds);
        #   one per backward, so an overwrite never loses an earlier backward's gradient;
        # - grad_buffer: what earlier backwards accumulated without a reduction (no_sync).
        self.grad_buffer: torch.Tensor | None = None
        self.contribution: torch.Tensor | None = None
        self._stash: dict[int, torch.Tensor] = {}
        self._stash_owned: set[int] = set()  # stashed tensors made here (sums), safe to add into in place
        # Parameters that received a gradient not reduced yet, and those whose reduction is in
        # flight: a parameter frozen after some micro-batches keeps what they accumulated (as
        # .grad does in plain PyTorch), so install_grads installs these besides the trainable ones.
        self._unreduced: set[int] = set()
        # Parameters that received a gradient here since the last reduction's install decision
        # (no_sync micro-batches included), and those whose .grad the last installs created.
        self.used_since_sync: set[int] = set()
        self.fresh_grads: set[int] = set()
        self._reducing: set[int] = set()
        # A gradient arrived since the group was last reduced or dropped (a parameter whose
        # output is unused never gets one).
        self.holds_grads = False
        self._grads_seen: set[int] = set()
        self.reduced_this_backward = False
        self.received_grads = False  # a gradient arrived here in this backward
        self.grads_complete = False  # every trainable parameter's gradient arrived in this backward
        # Reductions run on a copy of process_group (core/schedule.py), so that they never
        # interleave with all-gathers differently on different ranks.
        self.reduce_process_group: dist.ProcessGroup = self.process_group
        # HSDP, set_requires_all_reduce(False): shard-reduced gradients summed here instead of
        # all-reduced across dp_outer; the next all-reduce adds them in.
        self.requires_all_reduce = True
        self.partial_outer: torch.Tensor | None = None

    # -- construction -------------------------------------------------------
    def _local_rows(self, source: torch.Tensor, index: int) -> torch.Tensor:
        piece = self.layout.piece(index, self.shard_rank)
        return source.narrow(0, piece.row_start, piece.row_count) if source.dim() else source

    def shard_view(self, index: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows of parameter ``index`` inside a flat shard-sized tensor."""
        flat = self.shard if flat is None else flat
        slot = self.layout.slots[index]
        piece = self.layout.piece(index, self.shard_rank)
        numel = piece.row_count * slot.row_numel
        return flat.narrow(0, piece.shard_offset, numel).view(piece.local_shape(slot.shape))

    def _fill_shard_from(self, refs: list[ParamRef]) -> None:
        with torch.no_grad():
            for i, ref in enumerate(refs):
                local = ref.param.to_local() if isinstance(ref.param, DTensor) else ref.param
                self.shard_view(i).copy_(self._local_rows(local.detach(), i))

    def _tp_local(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's piece of a full (global-shaped) value of parameter ``index``; ``full`` without TP."""
        spec = self.refs[index].tp
        return full if spec is None else spec.local_of(full)

    def fill_param(self, index: int, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full (global) value of parameter ``index`` into the shard."""
        self.shard_view(index).copy_(self._local_rows(self._tp_local(index, full), index))

    def loadable(self, index: int, value: torch.Tensor, key: str) -> torch.Tensor:
        """``value`` (full tensor, or DTensor in any layout) as this parameter's sharded DTensor.

        ``load_state_dict`` copies DTensors shard by shard; a DTensor laid out by
        stock DTensor code (``torch.chunk`` boundaries, e.g. from
        ``set_model_state_dict`` with a full state dict) would be copied into our
        ragged shards row-misaligned, so it is gathered and re-cut here.
        """
        shape = self.global_shape(index)
        if tuple(value.shape) != shape:
            raise RuntimeError(
                f"loading '{key}': the checkpoint holds shape {tuple(value.shape)}, the parameter has {shape}"
            )
        return self.relayout(index, value, self.dtype)

    def in_our_layout(self, index: int, value: DTensor) -> bool:
        """``value``'s placements are exactly parameter ``index``'s (types and row counts)."""
        ours = self._placements(index)
        return list(value.placements) == ours and all(type(a) is type(b) for a, b in zip(value.placements, ours))

    def relayout(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (shaped like parameter ``index``: full, or a DTensor in any layout) in its layout.

        Collective when ``value`` is a DTensor not in our layout; every rank takes the same
        branch (the placements are the same on all ranks).
        """
        if isinstance(value, DTensor):
            if self.in_our_layout(index, value):
                return value  # already in our layout (a sharded state dict of this model)
            if self._holds_our_rows(value, index):
                local = value.to_local().detach().to(device=self.shard.device, dtype=dtype)
                return self.as_dtensor(index, local.contiguous())
            value = full_tensor(value)
        value = self._tp_local(index, value.detach())
        local = self._local_rows(value.to(device=self.shard.device, dtype=dtype), index)
        return self.as_dtensor(index, local.contiguous())

    def _holds_our_rows(self, value: DTensor, index: int) -> bool:
        """Whether ``value``'s local pieces are exactly this rank's rows of parameter ``index``.

        An out-of-place op on one of our shards (``sd[k].clone()``, ``.to(dtype)``, ``p * 2``,
        as FSDP2 users do to state dicts) comes back labelled plain ``Shard(0)`` with our
        ragged pieces (docs/design.md section 3); gathering it as ``torch.chunk`` pieces
        would be wrong, and refusing it broke such loads. When every rank's row count
        matches our layout, the pieces are ours and are taken as they are. One small
        all-gather per sharded mesh dim; every rank takes the same branch.
        """
        ours = self._placements(index)
        if value.device_mesh != self._mesh(index) or len(value.placements) != len(ours):
            return False
        for mesh_dim, (theirs, mine) in enumerate(zip(value.placements, ours)):
            if self.refs[index].tp is not None and mesh_dim == 0:
                if theirs != mine or type(theirs) is not type(mine):  # the TP dimension: the same placement
                    return False
            elif isinstance(mine, RaggedShard):
                if type(theirs) is not Shard or theirs.dim != 0 or mine.order != tuple(range(len(mine.order))):
                    return False
                if shard_sizes(value, mesh_dim) != list(mine.local_sizes):
                    return False
            elif not isinstance(theirs, Replicate):
                return False
        return True

    def _placements(self, index: int) -> list:
        if self.outer is not None:
            rows = self.outer.sizes_by_mesh_rank(self.layout.rows_per_rank(index))
            return [RaggedShard(0, rows, self.outer.order)]
        inner = RaggedShard(0, self.layout.rows_per_rank(index)) if self.gathers else Replicate()
        spec = self.refs[index].tp
        if spec is not None:  # (tp, dp) mesh: TP splits first, our rows split the TP-local tensor
            return [*spec.placements, inner]
        return [Replicate(), inner] if self.dp.has_outer else [inner]

    def _mesh(self, index: int):
        """The mesh parameter ``index``'s sharded DTensor lives on."""
        if index in self._tp_meshes:
            return self._tp_meshes[index]
        return self.dp.mesh if self.outer is None else self.outer.flat_mesh

    def global_shape(self, index: int) -> tuple[int, ...]:
        """Parameter ``index``'s shape as users see it (the global one under TP)."""
        spec = self.refs[index].tp
        return tuple(spec.shape) if spec is not None else self.layout.slots[index].shape

    def as_dtensor(self, index: int, local: torch.Tensor) -> DTensor:
        """Wrap this rank's piece of parameter ``index`` (or its grad) as a DTensor."""
        shape = self.global_shape(index)
        full_stride = torch.empty(shape, device="meta").stride()
        return as_ragged(strict_spec(DTensor.from_local(
            without_storage_offset(local), self._mesh(index), self._placements(index), run_check=False,
            shape=torch.Size(shape), stride=full_stride,
        )))

    def _make_sharded_param(self, index: int) -> nn.Parameter:
        original = self.refs[index].param
        with torch.no_grad():
            dtensor = self.as_dtensor(index, self.shard_view(index))
        param = strict_spec(nn.Parameter(dtensor, requires_grad=original.requires_grad))  # Parameter detaches
        copy_param_attributes(original, param)
        param._megatron_fsdp_sharded = True
        return param

    def applied(self, index: int, param: torch.Tensor, new_local: torch.Tensor) -> torch.Tensor:
        """``nn.Module._apply`` (``to_empty``, ``to`` ...) gave parameter ``index`` the local piece ``new_local``.

        Returns what the parameter becomes: a DTensor over this group's flat shard again,
        holding ``new_local``'s values. Otherwise the all-gather would go on reading the
        old shard, and FSDP2's meta-device idiom (``to_empty`` then
        ``reset_parameters()``) would train on other weights. A new device or dtype
        cannot be taken in place and raises.
        """
        view = self.shard_view(index)
        if new_local is param.to_local():
            return param  # nothing changed (e.g. .to() the device it is on)
        if new_local.device != view.device or new_local.dtype != view.dtype or new_local.shape != view.shape:
            raise NotImplementedError(
                f"parameter '{self.refs[index].fqn}' would become {new_local.dtype} {tuple(new_local.shape)} on "
                f"{new_local.device} after fully_shard (its shard is {view.dtype} {tuple(view.shape)} on "
                f"{view.device}); move and cast the module before fully_shard, or use mp_policy for the compute dtype"
            )
        with torch.no_grad():
            view.copy_(new_local)
        self.needs_init = False  # initialised by the caller (e.g. reset_parameters after to_empty)
        self.mark_compute_stale()
        return self.as_dtensor(index, view)

    def _make_unsharded_param(self, index: int) -> nn.Parameter:
        slot = self.layout.slots[index]
        source = self.unsharded.data if self.gathers else self.compute_shard
        view = source.narrow(0, slot.offset, slot.numel).view(slot.shape)
        spec = self.refs[index].tp
        # Under torch-native TP the module's plan computes with DTensors over the TP mesh.
        param = nn.Parameter(view if spec is None else spec.as_dtensor(view),
                             requires_grad=self.refs[index].param.requires_grad)
        copy_param_attributes(self.refs[index].param, param)
        # What a fused-wgrad kernel (TransformerEngine's, fuse_wgrad_accumulation) looks for,
        # set as megatron-core's DDP and NVIDIA's Megatron-FSDP set it: with the flag present TE
        # returns a dummy weight gradient (so the post-accumulate hook still fires) after adding
        # the real one to main_grad; with __fsdp_param__ it reads main_grad through
        # get_main_grad() in backward, so the buffer need not exist in forward.
        param.grad_added_to_main_grad = False
        param.__fsdp_param__ = True
        param.get_main_grad = partial(self.main_grad_of, index)
        if param.requires_grad:
            self._hook(index, param)
        return param

    def _hook(self, index: int, param: nn.Parameter) -> None:
        if index not in self._hooked:
            param.register_post_accumulate_grad_hook(partial(self._on_grad_accumulated, index))
            self._hooked.add(index)

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter of the group is trainable now."""
        return bool(self._grad_indices)

    def follow_requires_grad(self) -> None:
        """Give the compute-time parameters the sharded parameters' ``requires_grad``.

        The sharded parameters are the ones users see, so that is where a parameter is
        frozen or unfrozen after ``fully_shard`` (FSDP2 allows it: fine-tuning, BitFit).
        Without this the module computed with the old flag: autograd still produced the
        frozen weight's gradient and the optimizer updated it. Between micro-batches
        accumulated without a reduction, a ZeRO-1/2 or no_shard module still shows the
        compute-time parameter (kept gathered), so a flag changed there counts too: whichever
        of the two differs from the group's last flag (``_grad_indices``) was changed by the user.
        """
        for index, (sharded, unsharded) in enumerate(zip(self.sharded_params, self.unsharded_params)):
            was = index in self._grad_indices
            if sharded.requires_grad == was and unsharded.requires_grad == was:
                continue
            flag = not was
            sharded.requires_grad_(flag)
            unsharded.requires_grad_(flag)
            if flag:
                self._hook(index, unsharded)
                self._grad_indices.add(index)
            else:
                self._grad_indices.discard(index)
                unsharded.__dict__.pop("main_grad", None)
            self._grads_seen.clear()

    # -- weights ------------------------------------------------------------
    def check_unchanged(self) -> None:
        """Fail loudly if the user replaced or reshaped a parameter after wrapping; follow ``requires_grad``."""
        self.follow_requires_grad()
        for i, (ref, sharded, unsharded) in enumerate(zip(self.refs, self.sharded_params, self.unsharded_params)):
            self._check_not_replaced(ref, sharded, unsharded)
            if sharded.shape != ref.param.shape or sharded.to_local().shape != self.shard_view(i).shape:
                raise RuntimeError(
                    f"parameter '{ref.fqn}' changed shape after fully_shard: was "
                    f"{tuple(ref.param.shape)}, now {tuple(sharded.shape)}"
                )

    @staticmethod
    def _check_not_replaced(ref: ParamRef, sharded: nn.Parameter, unsharded: nn.Parameter) -> None:
        for module, name in ref.uses:
            current = module._parameters.get(name)
            if current is sharded or current is unsharded:
                continue
            if isinstance(current, DTensor):
                raise RuntimeError(
                    f"parameter '{ref.fqn}' was replaced by a DTensor on mesh {current.device_mesh} with placements "
                    f"{tuple(current.placements)} after fully_shard: torch-native tensor parallelism was applied "
                    "to a sharded module. Apply parallelize_module(module, mesh['tp'], plan) first, then "
                    "fully_shard(module, mesh=mesh['dp'])"
                )
            raise RuntimeError(
                f"parameter '{ref.fqn}' was replaced after fully_shard (now "
                f"{type(current).__name__} of shape {tuple(getattr(current, 'shape', ()))}); "
                "change parameters before wrapping, or wrap again from scratch"
            )

    def use(self, comm: CommConfig, pool: BufferPool, spares: GradSpares) -> None:
        """Run with the root's collectives config, buffer pool and gradient spares (an enclosing ``fully_shard``)."""
        self.comm = comm
        self.spares = spares
        if self.unsharded is not None and self.unsharded.pool is not pool:
            if self.unsharded.allocated:
                raise RuntimeError("ParamGroup.use: the unsharded weights are allocated; reshard first")
            self.unsharded.pool = pool

    def mark_compute_stale(self) -> None:
        """The main weights may change (an optimizer step may follow): refresh before next use.

        The post-forward shard is dropped too: it is a piece of the old weights.
        """
        self.post_forward_piece = None
        if self.compute_shard is not None and self.compute_shard is not self.shard:
            self.compute_stale = True

    def refresh_compute(self, chain: bool = False) -> Pending | None:
        """Copy (cast) the main shard into the compute shard, if it is stale.

        ``chain``, on side streams only: return the outer all-gather (outer 'optim') still in
        flight, for the inner all-gather to be chained after it (``all_gather(after=)``);
        otherwise it is waited for here.
        """
        pending = None
        if self.compute_stale:
            with torch.no_grad():
                if self.outer is not None:
                    pending = gather_compute_shard(self.compute_shard, self.shard, self.dp, comm=self.comm)
                    if not (chain and self.comm.stream_provider(self.device) is not None):
                        pending.wait()
                        pending = None
                else:
                    self.compute_shard.copy_(self.shard)
                    self.uploads += self.offload is not None
            self.compute_stale = False
            self.refreshes += 1
        return pending

    def start_compute_refresh(self) -> None:
        """The root's forward: refresh a stale compute shard here, in unit order, where every rank is.

        Outer 'optim' refreshes with a blocking all-gather across ``dp_outer``; issued at a
        unit's first gather instead, a rank that skipped units would reach it at another point
        than its peers (deadlock). On side streams it stays in flight, and this group's inner
        all-gather is chained after it (``_gather_input``); elsewhere it is waited for at once.
        """
        self.settle_compute_refresh()
        self._outer_refresh = self.refresh_compute(chain=True)

    def settle_compute_refresh(self) -> None:
        """Wait for an outer refresh no all-gather consumed (a unit that did not run), before the
        main shard it reads can change (the optimizer step) or another refresh writes its output."""
        if self._outer_refresh is not None:
            self._outer_refresh.wait()
            self._outer_refresh = None

    def _gather_input(self) -> tuple[torch.Tensor, dist.ProcessGroup, str, Pending | None]:
        """What this rank sends in the group's all-gather, over which group, counted as which kind.

        The post-forward piece within its sub-group if one is stored (the same on every
        rank, see ``core/post_forward_shard.py``); else the compute shard over the shard
        group, under CPU offload a fresh upload of the host shard. Last: the outer
        all-gather still filling the compute shard (side streams only), to chain after.
        """
        if self.post_forward_piece is not None:
            return self.post_forward_piece, self.post_forward.group, "all_gather_post_forward", None
        refresh = self.refresh_compute(chain=True)
        if refresh is None:  # the one started at the root's forward, if still in flight
            refresh, self._outer_refresh = self._outer_refresh, None
        if self.compute_shard is None:
            self.uploads += 1
            return upload(self.shard, self.compute_dtype, self.device), self.process_group, "all_gather", None
        return self.compute_shard, self.process_group, "all_gather", refresh

    def _store_piece_after(self, source: torch.Tensor, gathered: torch.Tensor) -> Callable[[], None] | None:
        """What to run once a gather into ``gathered`` landed: store the post-forward piece, if wanted."""
        if not self.keep_post_forward or self.post_forward is None or source is self.post_forward_piece:
            return None
        return partial(self._store_piece, gathered)

    def _store_piece(self, gathered: torch.Tensor) -> None:
        numel = self.layout.total_numel // self.post_forward.size
        self.post_forward_piece = gathered.narrow(0, self.post_forward.position * numel, numel).clone()

    def participate(self) -> Pending:
        """Issue this group's all-gather into scratch: the data is not needed here, the pairing is.

        The same collective ``start_unshard`` issues (group, kind, size), so ranks that
        use the weights and ranks that only take part pair up.
        """
        source, group, kind, refresh = self._gather_input()
        scratch = torch.empty(self.layout.total_numel, dtype=self.compute_dtype, device=self.device)
        pending = Pending(then=self._store_piece_after(source, scratch))
        try:
            return all_gather(scratch, source, group, kind=kind, into=pending, comm=self.comm, after=refresh)
        finally:
            pending.take_over(refresh)  # waiting for the gather waits for what filled its input

    def start_unshard(self) -> None:
        """Issue the all-gather of the weights (no-op if unsharded, in flight or landed)."""
        if self.state is GroupState.UNSHARDED or self._gather is not None:
            return
        if not self.gathers or self.post_forward_piece is not None:
            self.refresh_compute()  # a stored post-forward piece is gathered instead, but stays current
        if not self.gathers:
            return
        source, group, kind, refresh = self._gather_input()
        data = self.unsharded.allocate()
        # Refilling the weights in place for backward bumps the version counter
        # that autograd saved in forward; the values are the same ones forward
        # used, so the counter is restored once the gather lands.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(data)
        # Registered before issuing: whatever happens below, the works stay in sight.
        self._gather = Pending(then=self._store_piece_after(source, data))
        try:
            try:
                all_gather(data, source, group, kind=kind, into=self._gather, comm=self.comm, after=refresh)
            finally:
                self._gather.take_over(refresh)  # waiting for the gather waits for what filled its input
        except BaseException:
            if self._gather.in_flight:
                self.unsharded.abandon()  # a failed work may still write into it; _gather stays failed
            else:  # all_gather waited for what it had issued: nothing writes into the buffer
                self._gather = None
                self._version_guard.__exit__(None, None, None)
                self.unsharded.free()
            raise

    @property
    def gather_in_flight(self) -> bool:
        """An all-gather was issued and not yet waited for (or it failed: see ``wait_gather``)."""
        return self._gather is not None and not self._gather.done

    def wait_gather(self) -> None:
        """Wait for this group's all-gather, if one is in flight; its weights stay gathered.

        A gather that landed is installed by the next ``finish_unshard`` without gathering
        again, or freed by ``reshard``. If the gather failed, its error is raised here and
        by every later unshard or reshard, and the gathered buffer is abandoned: never
        freed nor reused, since a failed work may still write into it.
        """
        pending = self._gather
        if pending is None or pending.done:
            return
        try:
            pending.wait()
        except BaseException:
            if pending.failed:
                self.unsharded.abandon()
            raise
        self._version_guard.__exit__(None, None, None)

    def finish_unshard(self) -> None:
        """Wait for the all-gather and point the modules at the unsharded views."""
        if self.state is GroupState.UNSHARDED:
            return
        self.start_unshard()
        self.wait_gather()
        self._gather = None
        self._install(self.unsharded_params)
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Point the modules back at the sharded parameters and free the gathered weights.

        A prefetch nobody consumed is waited for first: memory a collective may still
        write into is never freed (the heap corruption of docs/design.md section 9).
        """
        self.wait_gather()
        self._gather = None
        if self.state is GroupState.UNSHARDED:
            self._install(self.sharded_params)
            self.state = GroupState.SHARDED
        if self.unsharded is not None:
            self.unsharded.free()

    def _install(self, params: list[nn.Parameter], *, check: bool = True) -> None:
        """Point every use at ``params``; ``check``: first refuse a parameter replaced behind our back
        (``parallelize_module`` after ``fully_shard``), which installing would silently undo, and carry
        a ``requires_grad`` set on the parameter shown until now over to the one shown next (a unit
        gathered without running its forward, e.g. skipped in a micro-batch, would hide it)."""
        if check:
            self.follow_requires_grad()
        for i, (ref, param) in enumerate(zip(self.refs, params)):
            if check:
                self._check_not_replaced(ref, self.sharded_params[i], self.unsharded_params[i])
            for module, name in ref.uses:
                module._parameters[name] = param

    # -- gradients ----------------------------------------------------------
    def _slot_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return buffer.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def main_grad_of(self, index: int) -> torch.Tensor:
        """The ``main_grad`` of parameter ``index``: a view of this backward's ``contribution`` buffer.

        The unsharded parameters' ``get_main_grad``: Megatron-LM's layers and TransformerEngine
        call it (in backward, or in forward) instead of reading ``main_grad`` when
        ``__fsdp_param__`` is set, and write the weight gradient into it. The buffer is made
        zeroed at the first call of a backward and sets ``main_grad`` on every trainable
        parameter of the group; it is folded into the gradients at the end of that backward
        (or its reduction), so what forward took is what backward fills.
        """
        if index not in self._grad_indices:
            raise RuntimeError(f"get_main_grad() of parameter '{self.refs[index].fqn}', which does not require "
                               "grad: only trainable parameters have a main_grad")
        if self.contribution is None:
            self.contribution = self.spares.zeros(self.layout.total_numel, self.grad_dtype, self.device)
            if self._stash:  # gradients that came first (a bias before its weight's kernel) go in now, in order
                self._stash_into(self.contribution, fresh=False)
            for i in self._grad_indices:
                self.unsharded_params[i].main_grad = self._slot_view(self.contribution, i)
        return self.unsharded_params[index].main_grad

    def _drop_main_grads(self) -> None:
        for i in self._grad_indices:
            self.unsharded_params[i].__dict__.pop("main_grad", None)

    def _on_grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        if param.grad is not None:
            # megatron-core DDP's rule: a fused wgrad kernel that set grad_added_to_main_grad has
            # already added its gradient to main_grad and .grad is its dummy, unless the weight
            # is also used by a plain op (a tied embedding/output weight): then it sets
            # zero_out_wgrad, the dummy is zeros and .grad holds the other uses' gradient.
            if not getattr(param, "grad_added_to_main_grad", False) or getattr(param, "zero_out_wgrad", False):
                spec = self.refs[index].tp
                self._accumulate(index, (param.grad if spec is None else spec.local_grad(param.grad)).detach())
            param.grad = None
        param.grad_added_to_main_grad = False  # consumed; the kernel sets it again in the next backward
        self._grads_seen.add(index)
        self.used_since_sync.add(index)
        self.received_grads = True
        self.holds_grads = True
        if self._grads_seen == self._grad_indices:
            self._grads_seen.clear()
            self.grads_complete = True
            self._on_grads_ready(self)

    def _accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Take one gradient of parameter ``index`` (a buffer's slot if one is open, else the stash)."""
        self._unreduced.add(index)
        buffer = self.contribution if self.contribution is not None else self.grad_buffer
        if buffer is not None:
            self._slot_view(buffer, index).add_(grad)
        elif index in self._stash_owned:
            self._stash[index].add_(grad)
        elif index in self._stash:  # a second gradient: another backward without a reduction, or
            # a second pass of one backward (reentrant checkpointing). Summed in grad_dtype, as in a buffer.
            self._stash[index] = self._stash[index].to(self.grad_dtype, copy=True).add_(grad)
            self._stash_owned.add(index)
        else:
            # A view of a larger gradient (a slice of what torch.cat's backward made) would keep
            # all of it alive until the reduction.
            base = grad._base
            self._stash[index] = grad.clone() if base is not None and base.numel() > grad.numel() else grad

    def _fold_contribution(self) -> None:
        """Move this backward's ``main_grad`` buffer into the accumulated gradients; drop the views."""
        if self.contribution is None:
            return
        if self.grad_buffer is None:
            self.grad_buffer = self.contribution
        else:
            self.grad_buffer.add_(self.contribution)
        self.contribution = None
        self._drop_main_grads()

    def _take_grads(self, zeros_if_none: bool, scaling: GradScaling) -> torch.Tensor | None:
        """The flat buffer of every gradient not reduced yet, scaled by ``scaling`` (None if there is
        none); the group keeps none.

        Stashed gradients are written into a buffer that is not zero-filled first, scaled on the
        way in (one pass instead of a copy and a scaling pass): only what they do not cover
        (alignment padding, parameters without a gradient) is zeroed.
        """
        self._fold_contribution()
        buffer, self.grad_buffer = self.grad_buffer, None
        if self._stash and buffer is None:
            buffer = self.spares.empty(self.layout.total_numel, self.grad_dtype, self.device)
            self._stash_into(buffer, fresh=True, scaling=scaling)
            return buffer
        if self._stash:
            self._stash_into(buffer, fresh=False)
        elif buffer is None and zeros_if_none:
            buffer = self.spares.zeros(self.layout.total_numel, self.grad_dtype, self.device)
        if buffer is not None:
            scaling.apply(buffer, self.dp.size)
        return buffer

    def _stash_into(self, buffer: torch.Tensor, fresh: bool, scaling: GradScaling | None = None) -> None:
        """Add the stash into ``buffer``, or (``fresh``) write it there scaled by ``scaling``, zeroing the gaps."""
        stash, self._stash = self._stash, {}
        self._stash_owned = set()
        if not fresh:
            for index, grad in stash.items():
                self._slot_view(buffer, index).add_(grad)
            return
        end = 0
        for index in sorted(stash, key=lambda i: self.layout.slots[i].offset):
            slot = self.layout.slots[index]
            if slot.offset > end:
                buffer.narrow(0, end, slot.offset - end).zero_()
            scaling.write(self._slot_view(buffer, index), stash.pop(index), self.dp.size)  # each freed once written
            end = slot.offset + slot.numel
        if buffer.numel() > end:
            buffer.narrow(0, end, buffer.numel() - end).zero_()

    def scale_unreduced(self, factor: float) -> None:
        """Multiply the gradients not reduced yet by ``factor``."""
        for buffer in (self.grad_buffer, self.contribution):
            if buffer is not None:
                buffer.mul_(factor)
        for index, grad in self._stash.items():
            if index in self._stash_owned:
                grad.mul_(factor)
            else:  # autograd's tensor, which a hook of the user's may still reference: scale a
                # copy, widened to grad_dtype as a buffer would hold it (a bf16 product rounds)
                self._stash[index] = grad.to(self.grad_dtype) * factor
                self._stash_owned.add(index)

    def discard_unreduced_grads(self) -> None:
        """Drop gradients accumulated but not reduced yet (``zero_grad_buffer``)."""
        self.grad_buffer = None
        self.contribution = None
        self._stash = {}
        self._stash_owned = set()
        self._unreduced = set()
        self.used_since_sync = set()
        self.holds_grads = False
        self.partial_outer = None
        self._drop_main_grads()
        for index, param in enumerate(self.unsharded_params):
            param.grad_added_to_main_grad = False  # megatron-core's zero_grad_buffer resets it too
            self._sync_sharded_main_grad(index)
        self.end_backward()

    def _sync_sharded_main_grad(self, index: int) -> None:
        """Make the sharded parameter's ``main_grad`` its ``.grad`` (absent when it has none).

        Megatron-LM's optimizers and clipping read ``param.main_grad`` of the parameters they
        are given; here those are the sharded ones, whose gradient is the reduced ``.grad``.
        """
        param = self.sharded_params[index]
        if param.grad is None:
            param.__dict__.pop("main_grad", None)
        else:
            param.main_grad = param.grad

    def sync_sharded_main_grads(self) -> None:
        """Re-point every sharded ``main_grad`` at ``.grad`` (dropping it where ``.grad`` is None).

        ``optimizer.zero_grad()`` sets ``.grad`` to None but cannot know of the alias, so a
        parameter that gets no gradient in the next backward would otherwise keep last
        step's gradient as ``main_grad`` for Megatron-LM's optimizer and clipping to read.
        """
        for index in self._grad_indices:
            self._sync_sharded_main_grad(index)

    def drop_unused_fresh_grads(self, used: set[int] | None) -> None:
        """Undo the ``.grad`` the last installs created for parameters no rank had a gradient for.

        ``used``: the parameters some rank of the reduction group had a gradient for since
        the last reduction (None: unknown, keep everything). As DDP and FSDP2 leave such a
        parameter's ``.grad`` as it was, a zero one (which AdamW would decay) is not kept.
        """
        if self.partial_outer is not None:  # HSDP held back: nothing installed, the bits run on
            return
        fresh, self.fresh_grads = self.fresh_grads, set()
        self.used_since_sync = set()
        if used is None:
            return
        for i in sorted(fresh - used):
            self.sharded_params[i].grad = None
            self._sync_sharded_main_grad(i)

    def end_backward(self) -> None:
        """Reset the per-backward gradient bookkeeping; drop the post-forward shard."""
        self._fold_contribution()  # the next backward's fused kernels get a fresh main_grad buffer
        self.settle_compute_refresh()
        self.post_forward_piece = None
        self._grads_seen.clear()
        self.reduced_this_backward = False
        self.received_grads = False
        self.grads_complete = False

    @property
    def grads_pending(self) -> bool:
        """Gradients are accumulated here but not fully reduced (nor installed as ``.grad``)."""
        unreduced = self.grad_buffer is not None or self.contribution is not None or bool(self._stash)
        return (unreduced and not self.reduced_this_backward) or self.partial_outer is not None

    def reduce_grads(self, sync: bool, scaling: GradScaling, *, zeros_if_none: bool = False) -> PendingReduce | None:
        """Start reducing the accumulated gradients (unless ``sync`` is off).

        ``zeros_if_none``: with nothing accumulated here, reduce zeros (this rank
        still takes part in a reduction other ranks issue).
        """
        if not sync:
            return None
        buffer = self._take_grads(zeros_if_none, scaling)
        if buffer is None:
            return None
        self.holds_grads = False
        self._drop_main_grads()
        self._reducing |= self._unreduced | self._grad_indices
        self._unreduced = set()
        self.reduced_this_backward = True
        if self.comm_dtype != buffer.dtype:
            buffer = buffer.to(self.comm_dtype)
        if self.dp.shard_size == 1:
            reduce = PendingReduce(self, Pending(None), buffer)
        elif self.plan.grads:
            # dp_shard's share of the gradients: the main shard, or under outer 'optim' the compute shard.
            numel = self.layout.shard_numel * (self.outer.outer_size if self.outer is not None else 1)
            output = torch.empty(numel, dtype=buffer.dtype, device=buffer.device)
            work = reduce_scatter(output, buffer, self.reduce_process_group, input_is_scratch=True, comm=self.comm)
            # No gradient aliases the buffer; a cast copy (comm dtype) is not worth keeping.
            reduce = PendingReduce(self, work, output, scratch=buffer if buffer.dtype == self.grad_dtype else None)
        else:
            work = all_reduce(buffer, self.reduce_process_group, comm=self.comm, stream=REDUCE_STREAM)
            n = self.layout.shard_numel
            reduce = PendingReduce(self, work, buffer.narrow(0, self.shard_rank * n, n))
        if self.comm.stream_provider(buffer.device) is not None and self._outer_stage_issues:
            reduce.chain_outer()
        return reduce

    @property
    def _outer_stage_issues(self) -> bool:
        """Reducing gradients issues a collective across dp_outer (HSDP, not held back)."""
        return self.outer is not None or (self.dp.has_outer and self.dp.outer_size > 1 and self.requires_all_reduce)

    def start_outer_reduction(
        self, reduced_shard: torch.Tensor, after: Pending | None = None
    ) -> tuple[Pending, torch.Tensor]:
        """HSDP: start summing the dp_shard-reduced gradients over dp_outer.

        Returns the work and where this rank's main-shard part lands: outer 'optim'
        reduce-scatters into this rank's piece; a replicating outer dimension
        all-reduces in place; without an outer dimension nothing is issued.
        ``after``: the inner reduction producing ``reduced_shard``, still in flight (on
        side streams only: the outer stream waits on its events; see ``PendingReduce.chained``).
        """
        if self.outer is not None:
            piece = torch.empty(self.layout.shard_numel, dtype=reduced_shard.dtype, device=reduced_shard.device)
            return (
                reduce_scatter(piece, reduced_shard, self.dp.outer_group, kind="reduce_scatter_outer", comm=self.comm,
                               stream=OUTER_STREAM, after=after),
                piece,
            )
        if self.dp.has_outer and self.dp.outer_size > 1:
            if not self.requires_all_reduce:  # never chained: the inner reduction has landed
                if self.partial_outer is not None:
                    reduced_shard = reduced_shard.add_(self.partial_outer)
                self.partial_outer = reduced_shard
                return Pending(), None
            partial, self.partial_outer = self.partial_outer, None
            return all_reduce(reduced_shard, self.dp.outer_group, comm=self.comm, stream=OUTER_STREAM, after=after,
                              accumulate=partial), reduced_shard
        return Pending(), reduced_shard

    def install_grads(self, reduced_shard: torch.Tensor) -> None:
        """Add the reduced shard into the sharded parameters' ``.grad`` (creating them).

        Under CPU offload the shard is first copied to the host, where the gradients live.
        """
        if self.offload is not None:
            reduced_shard = download(reduced_shard, self.dtype, self.offload)
            self.downloads += 1
        installing, self._reducing = self._reducing | self._grad_indices, set()
        for i in sorted(installing):
            param = self.sharded_params[i]
            local = self.shard_view(i, reduced_shard).to(self.dtype)
            if param.grad is None:
                param.grad = self.as_dtensor(i, local)
                self.fresh_grads.add(i)
            else:
                param.grad.to_local().add_(local)
            self._sync_sharded_main_grad(i)
            # As FSDP2 does: the sharded parameter's .grad is set by us, not by autograd's
            # AccumulateGrad, so its post-accumulate hooks (optimizer in backward) run here.
            for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(param)


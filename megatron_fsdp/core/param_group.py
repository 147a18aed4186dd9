"""ParamGroup: one unit's parameters that share dtype and requires_grad.

The group is cut along its concerns, as PyTorch FSDP2 cuts ``FSDPParam`` from
``FSDPParamGroup``: each parameter's representations (sharded DTensor, unsharded view,
TP placement, relayout on load) are an ``FSDPParam`` (``core/fsdp_param.py``); the
gather/reshard state machine is ``WeightPath`` (``core/group_weights.py``); the gradient
path (stash, accumulate, reduce, install) is ``GradientPath`` (``core/group_grads.py``).
This module builds the storage both paths work on and follows the user's changes to the
parameters (``requires_grad``, ``to_empty``, replaced parameters).

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

import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from megatron_fsdp.comm.collectives import DEFAULT_COMM, CommConfig, Pending
from megatron_fsdp.core.fsdp_param import FSDPParam, ParamRef, ShardGeometry, copy_param_attributes
from megatron_fsdp.core.gather_extension import GATHER_DTYPE, GatherExtension
from megatron_fsdp.core.group_grads import GradientPath
from megatron_fsdp.core.group_weights import GroupState, WeightPath
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.offload import host_empty
from megatron_fsdp.core.post_forward_shard import PostForwardMesh
from megatron_fsdp.core.quantized_gather import QuantizedGather
from megatron_fsdp.memory.allocator import BufferPool
from megatron_fsdp.memory.buffer import FlatBuffer
from megatron_fsdp.memory.grad_buffers import GradSpares
from megatron_fsdp.sharding.layout import FlatLayout, alignment_numel, build_flat_layout
from megatron_fsdp.sharding.mesh import DataParallelMesh
from megatron_fsdp.sharding.outer_shard import outer_shard_geometry
from megatron_fsdp.sharding.strategy import ShardingPlan

if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffloadPolicy


def flat_alignment(dtype: torch.dtype, policy: MixedPrecisionPolicy | None) -> int:
    """The layout's ``align`` for parameters of ``dtype``: 16 bytes in the narrowest dtype their group
    holds a flat buffer in (main, compute, gradient, communication; ``layout.alignment_numel``)."""
    policy = policy or MixedPrecisionPolicy(main_params_dtype=None)
    return alignment_numel(d.itemsize for d in policy.dtypes_for(dtype))


# id of each sharded parameter -> (a weak reference to its group, its index): the optimizer hooks ask at
# every step whether a parameter is ours, in time proportional to the optimizer's parameters, not to every
# parameter of every unit alive in the process. Not a weak reference to the parameter: torch cannot swap
# a tensor that has one (``model.to()`` under swap_module_params_on_conversion).
_OWNERS: dict[int, tuple[weakref.ref, int]] = {}


def _forget(ids: list[int], group_ref: weakref.ref) -> None:
    """A group was collected: drop its entries (those a newer group has taken over stay)."""
    for key in ids:
        if _OWNERS.get(key, (None,))[0] is group_ref:
            del _OWNERS[key]


def _call_weakly(method: weakref.WeakMethod, *args: object) -> object:
    """``method(*args)`` of a group reached weakly from its own compute-time parameters.

    A strong reference (a bound method in the parameter's hook or attribute) closes a cycle the
    collector cannot see through: torch visits a tensor's hooks and attributes only while Python holds
    its only reference, and the autograd graph and the flat buffer's views hold these parameters too.
    The group, its flat buffers and the unit stayed alive after the model was gone.
    """
    bound = method()
    if bound is None:
        raise RuntimeError("this parameter's megatron_fsdp unit was freed (its model is gone); "
                           "keep the fully_shard-ed module alive while its parameters are used")
    return bound(*args)


_replacements = 0  # parameters taken over from a replacement (``ParamGroup._take_replacement``) so far


def replaced_in(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of parameters ``optimizer`` holds that were replaced after ``fully_shard`` and taken over.

    Such an object holds the replaced tensor, not the module's parameter any more: a step would update
    nothing the model uses (FSDP2's optimizer silently goes stale the same way). Free when nothing was
    ever replaced.
    """
    if not _replacements:
        return []
    return [name for group in optimizer.param_groups for p in group["params"]
            if (name := getattr(p, "_megatron_fsdp_replaced", None)) is not None]


def owner_of(param: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """The live group whose sharded parameter ``param`` is, and its index there (None: not one of ours)."""
    entry = _OWNERS.get(id(param))
    group = entry[0]() if entry is not None else None
    if group is None or group.sharded_params[entry[1]] is not param:
        return None  # its group is gone, or the id now names another tensor
    return group, entry[1]


class ParamGroup(WeightPath, GradientPath):
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

        if offload is not None:
            self.shard = host_empty(self.layout.shard_numel, self.dtype, offload).zero_()
        else:
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        self.gathers = plan.optim and dp.shard_size > 1
        geometry = ShardGeometry(self.layout, dp, self.shard_rank, self.gathers, self.outer, self.shard)
        self.params = [FSDPParam(i, ref, geometry) for i, ref in enumerate(refs)]
        # Meta-device parameters are filled later by meta_init.materialize_meta, unless values reach them
        # first through the engine (a load, ``to_empty``): the indices still waiting for values.
        self.pending_init: set[int] = set(range(len(refs))) if first.device.type == "meta" else set()
        with torch.no_grad():
            for param, ref in zip(self.params, refs):
                if self.pending_init:
                    if self.dtype.is_floating_point:
                        param.shard_view().fill_(float("nan"))  # "no values yet", until written (written_pending)
                else:
                    param.fill_from(ref.param)
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
        self.sharded_params = [p.make_sharded(p.ref.param) for p in self.params]
        # Each sharded parameter's attribute dict (the object itself: attributes set later are in it), which
        # torch.utils.swap_tensors carries away with the contents (``_take_contents`` puts it back).
        self._attributes = [param.__dict__ for param in self.sharded_params]
        self._owner_ids: list[int] = []  # the registry's keys of this group, forgotten when it is collected
        self._self_ref = weakref.ref(self, partial(_forget, self._owner_ids))
        for index in range(len(self.sharded_params)):
            self._register_owner(index)
        # FSDP2's all-gather extension (torchao's float8 weights): the gather moves what the
        # parameters' pre-hooks return, in a flat buffer of bytes (core/gather_extension.py).
        self.extension: GatherExtension | None = None
        if self.gathers and self.params[0].extension is not None:
            self._check_extension_supported()
            self.extension = GatherExtension(
                self.params, self.sharded_params, self.layout, dp, policy, self.compute_dtype, device)
        # MixedPrecisionPolicy(gather_dtype=float8 or gather_format="mxfp8"): the gather moves float8 of the
        # main weights, dequantized into the compute buffer (core/quantized_gather.py); parameters with
        # hooks gather what those decide.
        self.quantized: QuantizedGather | None = None
        if (self.gathers and policy.quantized_gather_dtype is not None and self.extension is None
                and self.compute_dtype.is_floating_point):
            self._check_quantized_supported(
                f"gather_format={policy.gather_format!r}" if policy.gather_format is not None
                else f"gather_dtype={policy.gather_dtype}")
            self.quantized = QuantizedGather(self.params, policy.quantized_gather_dtype, self.compute_dtype, device,
                                             self.process_group, block_scaled=policy.gather_format == "mxfp8")
        self.unsharded = (
            FlatBuffer(self.layout.total_numel, self.compute_dtype, device, allocated=True, pool=pool)
            if self.gathers and self.extension is None
            else FlatBuffer(self.extension.total_numel, GATHER_DTYPE, device, allocated=True, pool=pool)
            if self.gathers
            else None
        )
        # Trainable parameters (gradient hooks, views into the grad buffer). Follows the
        # sharded parameters' requires_grad at every forward (follow_requires_grad).
        self._grad_indices = {i for i, r in enumerate(refs) if r.param.requires_grad}
        self._hooked: set[int] = set()  # unsharded parameters with a post-accumulate-grad hook
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
        self._init_grads(on_grads_ready)

    @property
    def needs_init(self) -> bool:
        """Whether some parameter still waits for its values (built on meta, nothing loaded into it yet)."""
        return bool(self.pending_init)

    def _register_owner(self, index: int) -> None:
        """``owner_of(self.sharded_params[index])`` answers this group and ``index`` from now on."""
        key = id(self.sharded_params[index])
        self._owner_ids.append(key)
        _OWNERS[key] = (self._self_ref, index)

    def written_pending(self) -> list[int]:
        """Indices still waiting for values that were written in place behind the engine's back.

        A meta-built model's shard is real memory from the start (ours, unlike FSDP2's meta DTensors), so
        ``p.copy_(...)``, ``nn.init``, ``p.data`` or ``dcp.load`` into ``model.state_dict()`` (which copies
        into the local tensors) write into it. Its waiting rows hold NaN from the start (``__init__``): a
        parameter whose rows here are not all NaN was written. (A rank holding none of its rows sees
        nothing; ``materialize_meta`` decides with the other ranks.)
        """
        written = []
        for index in sorted(self.pending_init):
            view = self.params[index].shard_view()
            if view.is_floating_point() and view.numel() and not bool(torch.isnan(view).all()):
                written.append(index)
        return written

    def applied(self, index: int, param: torch.Tensor, new_local: torch.Tensor) -> torch.Tensor:
        """``nn.Module._apply`` (``to_empty``, ``to`` ...) gave parameter ``index`` the local piece ``new_local``.

        Returns what the parameter becomes: a DTensor over this group's flat shard again,
        holding ``new_local``'s values. Otherwise the all-gather would go on reading the
        old shard, and FSDP2's meta-device idiom (``to_empty`` then
        ``reset_parameters()``) would train on other weights. A new device or dtype
        cannot be taken in place and raises.
        """
        view = self.params[index].shard_view()
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
        self.pending_init.discard(index)  # initialised by the caller (e.g. reset_parameters after to_empty)
        self.mark_compute_stale()
        return self.params[index].as_dtensor(self.params[index].wrap_local(view))

    def _make_unsharded_param(self, index: int) -> nn.Parameter:
        if self.extension is not None:  # the post-hook's tensor over the gathered payload
            tensor = self.extension.build(index, self.unsharded.data)
        else:  # under torch-native TP the module's plan computes with DTensors over the TP mesh
            tensor = self.params[index].unsharded_view(self.unsharded.data if self.gathers else self.compute_shard)
        param = nn.Parameter(tensor, requires_grad=self.refs[index].param.requires_grad)
        copy_param_attributes(self.refs[index].param, param)
        # What a fused-wgrad kernel (TransformerEngine's, fuse_wgrad_accumulation) looks for,
        # set as megatron-core's DDP and NVIDIA's Megatron-FSDP set it: with the flag present TE
        # returns a dummy weight gradient (so the post-accumulate hook still fires) after adding
        # the real one to main_grad; with __fsdp_param__ it reads main_grad through
        # get_main_grad() in backward, so the buffer need not exist in forward.
        param.grad_added_to_main_grad = False
        param.__fsdp_param__ = True
        param.get_main_grad = partial(_call_weakly, weakref.WeakMethod(self.main_grad_of), index)
        if param.requires_grad:
            self._hook(index, param)
        return param

    def _hook(self, index: int, param: nn.Parameter) -> None:
        if index not in self._hooked:
            param.register_post_accumulate_grad_hook(
                partial(_call_weakly, weakref.WeakMethod(self._on_grad_accumulated), index))
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

    def check_unchanged(self) -> None:
        """Take over parameters the user replaced after wrapping, or fail loudly; follow ``requires_grad``."""
        self.follow_requires_grad()
        for i, ref in enumerate(self.refs):
            self._check_not_replaced(i)  # may take a replacement over: read the parameter after it
            sharded = self.sharded_params[i]
            if sharded.shape != ref.param.shape or sharded.to_local().shape != self.params[i].shard_view().shape:
                raise RuntimeError(
                    f"parameter '{ref.fqn}' changed shape after fully_shard: was "
                    f"{tuple(ref.param.shape)}, now {tuple(sharded.shape)}"
                )

    def _check_not_replaced(self, index: int) -> None:
        """Where a module no longer holds parameter ``index`` (ours), take the replacement over or raise.

        ``module.weight = nn.Parameter(...)``, ``register_parameter`` and ``torch.utils.swap_tensors``
        after ``fully_shard`` put a tensor the engine never gathers in the module (FSDP2 takes it as its
        sharded parameter before its first forward and after a load or ``_apply``). Its values are copied
        into our shard (re-laid out like a loaded value) and the object itself becomes our sharded
        parameter (``swap_tensors``), so that what the module computes with, what it shows and what an
        optimizer built from ``model.parameters()`` steps are one thing.
        """
        ref, sharded, unsharded = self.refs[index], self.sharded_params[index], self.unsharded_params[index]
        currents = [module._parameters.get(name) for module, name in ref.uses]
        if all(c is sharded or c is unsharded for c in currents):
            if not self._holds_our_shard(index):  # torch.utils.swap_tensors(param, other): ours, other contents
                self._take_contents(index)
            return
        current = next(c for c in currents if c is not sharded and c is not unsharded)
        if parametrize.is_parametrized(ref.uses[currents.index(current)][0], ref.uses[currents.index(current)][1]):
            raise RuntimeError(
                f"parameter '{ref.fqn}' was parametrized after fully_shard "
                "(torch.nn.utils.parametrize.register_parametrization): the parametrization would compute "
                "from the sharded parameter (FSDP2 fails the same way). Register parametrizations before "
                "fully_shard: the engine then shards the parametrization's 'original' tensor"
            )
        if isinstance(current, DTensor) and current.device_mesh != self.params[index].mesh:
            raise RuntimeError(
                f"parameter '{ref.fqn}' was replaced by a DTensor on mesh {current.device_mesh} with placements "
                f"{tuple(current.placements)} after fully_shard: torch-native tensor parallelism was applied "
                "to a sharded module. Apply parallelize_module(module, mesh['tp'], plan) first, then "
                "fully_shard(module, mesh=mesh['dp'])"
            )
        problem = (
            "it is not a tensor" if not isinstance(current, torch.Tensor)
            else f"shape {tuple(current.shape)} is not {tuple(sharded.shape)}" if current.shape != sharded.shape
            else f"dtype {current.dtype} is not {sharded.dtype}" if current.dtype != sharded.dtype
            else "it replaced the parameter in some of the modules that share it only" if len(
                {id(c) for c in currents}) > 1
            else "the module holds its gathered (unsharded) weights now; call reshard() first"
            if self.state is not GroupState.SHARDED
            else None
        )
        if problem is None:
            try:
                self._take_replacement(index, current)
                return
            except RuntimeError as exc:  # swap_tensors refuses a tensor referenced elsewhere (autograd, weakref)
                problem = f"it cannot take the place of the sharded parameter ({exc})"
        raise RuntimeError(
            f"parameter '{ref.fqn}' was replaced after fully_shard by {type(current).__name__} and "
            f"cannot be used: {problem}. Write new values in place instead (with torch.no_grad(): "
            "param.copy_(value)), or load them with model.load_state_dict(...)"
        )

    def _holds_our_shard(self, index: int) -> bool:
        """Whether sharded parameter ``index`` still is a view of its rows of our shard."""
        if self.params[index].extension is not None:
            return True  # a tensor subclass over the shard (torchao): its own swaps are its class's concern
        local = getattr(self.sharded_params[index], "_local_tensor", None)
        return local is not None and self.params[index].is_shard_view(local)

    def _take_contents(self, index: int) -> None:
        """Our sharded parameter object was given another tensor's contents (``torch.utils.swap_tensors``):
        those values go into our shard and the object becomes a view of it again, as FSDP2 re-reads it."""
        param = self.sharded_params[index]
        if param.shape != self.refs[index].param.shape or param.dtype != self.dtype:
            raise RuntimeError(
                f"parameter '{self.refs[index].fqn}' was given a {param.dtype} tensor of shape "
                f"{tuple(param.shape)} after fully_shard (torch.utils.swap_tensors); its values must keep "
                f"shape {tuple(self.refs[index].param.shape)} and dtype {self.dtype}"
            )
        self._write_into_shard(index, param)
        fresh = self.params[index].make_sharded(param)
        requires_grad = param.requires_grad
        attributes = self._attributes[index]
        torch.utils.swap_tensors(param, fresh)
        param.__dict__ = attributes  # ours, with what was set on the parameter since fully_shard
        param.requires_grad_(requires_grad)

    def _take_replacement(self, index: int, new: torch.Tensor) -> None:
        """``new`` becomes parameter ``index``: its values go into our shard, its object becomes ours."""
        old = self.sharded_params[index]
        requires_grad = new.requires_grad
        users_attributes = dict(getattr(new, "__dict__", {}))
        self._write_into_shard(index, new)
        torch.utils.swap_tensors(new, old)  # ``new`` is now a DTensor over our shard; ``old`` holds its tensor
        new.requires_grad_(requires_grad)
        for key, attribute in users_attributes.items():
            if not key.startswith("_megatron_fsdp"):
                setattr(new, key, attribute)
        old._megatron_fsdp_replaced = self.refs[index].fqn  # an optimizer still holding it is refused
        global _replacements
        _replacements += 1
        self.sharded_params[index] = new
        self._attributes[index] = new.__dict__
        self._register_owner(index)
        self.follow_requires_grad()

    def _write_into_shard(self, index: int, value: torch.Tensor) -> None:
        """``value`` (shaped like parameter ``index``, in any layout) becomes its rows of our shard."""
        local = self.params[index].loadable(value.detach(), self.refs[index].fqn, self.dtype).to_local()
        with torch.no_grad():
            self.params[index].shard_view().copy_(local)
        self.pending_init.discard(index)
        self.mark_compute_stale()

    def use(self, comm: CommConfig, pool: BufferPool, spares: GradSpares) -> None:
        """Run with the root's collectives config, buffer pool and gradient spares (an enclosing ``fully_shard``)."""
        self.comm = comm
        self.spares = spares
        if self.unsharded is not None and self.unsharded.pool is not pool:
            if self.unsharded.allocated:
                raise RuntimeError("ParamGroup.use: the unsharded weights are allocated; reshard first")
            self.unsharded.pool = pool

    def _layouts_custom_gathers_lack(self) -> list[tuple[bool, str]]:
        """(applies, name) of the layouts neither the all-gather extension nor the float8 gather is built for."""
        return [
            (any(r.tp is not None for r in self.refs), "torch-native tensor parallelism"),
            (self.offload is not None, "CPU offload"),
            (self.post_forward is not None, "reshard_after_forward=<int>"),
            (self.outer is not None, "HSDP outer_sharding_strategy='optim'"),
        ]

    def _check_extension_supported(self) -> None:
        """Refuse what the all-gather extension is not built for, naming it (the gather would be wrong)."""
        kinds = {p.extension for p in self.params}
        name = self.params[0].extension.__name__
        unsupported = [
            (len(kinds) > 1, f"parameters of several classes {sorted(k.__name__ if k else 'Tensor' for k in kinds)}"),
            *self._layouts_custom_gathers_lack(),
        ]
        for refused, what in unsupported:
            if refused:
                raise NotImplementedError(
                    f"fully_shard: parameters with FSDP2 all-gather hooks ({name}: {[r.fqn for r in self.refs]}) "
                    f"are not supported with {what}"
                )

    def _check_quantized_supported(self, option: str) -> None:
        """Refuse what the float8 gather (``option``: ``gather_dtype=...`` or ``gather_format=...``) is not
        built for, naming it."""
        for refused, what in self._layouts_custom_gathers_lack():
            if refused:
                raise NotImplementedError(
                    f"fully_shard: MixedPrecisionPolicy({option}) is not supported with {what} "
                    f"(parameters {[r.fqn for r in self.refs]})"
                )


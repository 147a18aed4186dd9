"""The all-gather of a group whose parameters define FSDP2's tensor-subclass hooks.

PyTorch FSDP2 lets a parameter's local tensor decide what its all-gather moves:
``fsdp_pre_all_gather`` turns this rank's rows into the payload (torchao's float8 weights:
the rows cast to float8 with a scale agreed across ranks, 1 byte per element) and
``fsdp_post_all_gather`` turns the gathered payload into the tensor the module computes
with (a ``Float8TrainingTensor``). Here the payload travels in the group's flat buffer
(docs/design.md section 13): each parameter's payload sits at its rows' place in a flat
shard of the payload dtype, one all-gather fills the whole buffer, and each parameter's
gathered payload is a view of it (no copy-out), which the post-hook wraps.

The buffer is sent as ``uint8``: the same bytes, and gloo has no float8 type (PyTorch
FSDP2 fails there with "Invalid scalar type"). Metadata (torchao: the scale) stays on each
rank, as in FSDP2; the hooks agree on it across ranks themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_fsdp.core.fsdp_param import FSDPParam
from megatron_fsdp.sharding.layout import FlatLayout
from megatron_fsdp.sharding.mesh import DataParallelMesh

GATHER_DTYPE = torch.uint8  # what the collective sees of any payload


class GatherExtension:
    """The payload all-gather of one group whose every parameter has the hooks of one class."""

    def __init__(
        self,
        params: list[FSDPParam],
        sharded_params: list[nn.Parameter],
        layout: FlatLayout,
        dp: DataParallelMesh,
        policy: Any,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.params = params
        self.sharded_params = sharded_params  # the group's list: read at every gather
        self.layout = layout
        self.policy = policy
        self.compute_dtype = compute_dtype
        self.device = device
        self.mesh = _shard_mesh(dp)
        for p in params:
            empty = [r for r, rows in enumerate(layout.rows_per_rank(p.index)) if rows == 0]
            if empty:
                raise NotImplementedError(
                    f"parameter '{p.fqn}' ({p.extension.__name__}, {p.slot.shape[0]} rows) has no rows on "
                    f"data-parallel rank(s) {empty} of {len(layout.rows_per_rank(p.index))}: its all-gather hook "
                    "works on each rank's rows (torchao takes their amax) and cannot run on an empty piece; "
                    "use fewer data-parallel ranks or leave this parameter out of the conversion"
                )
        # The payload dtype comes from the hooks themselves: run them once (torchao's dynamic
        # scale all-reduces the amax over the mesh, so every rank does this at the same point).
        payloads = [self._pre(i) for i in range(len(params))]
        dtypes = {payload.dtype for payload, _ in payloads}
        if len(dtypes) != 1:
            raise NotImplementedError(
                f"the all-gather hooks of {[p.fqn for p in params]} return payloads of dtypes "
                f"{sorted(map(str, dtypes))}; one flat buffer carries one dtype"
            )
        self.dtype: torch.dtype = dtypes.pop()
        self.itemsize = self.dtype.itemsize
        self.metadata: list[Any] = [metadata for _, metadata in payloads]

    @property
    def total_numel(self) -> int:
        """Bytes of the gathered buffer (``uint8`` elements)."""
        return self.layout.total_numel * self.itemsize

    def _pre(self, index: int) -> tuple[torch.Tensor, Any]:
        param = self.params[index]
        module = param.ref.uses[0][0]
        with torch.no_grad():
            return param.pre_all_gather(self.sharded_params[index]._local_tensor, self.mesh, module, self.policy)

    def gather_input(self) -> torch.Tensor:
        """This rank's payload shard, as ``uint8``: every parameter's pre-hook output at its rows' place.

        Collective when a hook is (torchao's dynamic scale): every rank that takes part in the
        group's all-gather calls this, those that only participate too.
        """
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        for index, param in enumerate(self.params):
            payload, self.metadata[index] = self._pre(index)
            param.shard_view(shard).copy_(payload)
        return shard.view(GATHER_DTYPE)

    def gathered(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s whole payload inside the gathered ``uint8`` buffer, shaped and typed."""
        return self.params[index].slot_view(buffer.view(self.dtype))

    def build(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """The compute-time tensor of parameter ``index`` over ``buffer`` (made once, refreshed by ``refresh``)."""
        with torch.no_grad():
            return self.params[index].post_all_gather(
                self.sharded_params[index]._local_tensor, self.gathered(index, buffer), self.metadata[index],
                self.compute_dtype)

    def refresh(self, unsharded_params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        """After a gather landed in ``buffer``: give every compute-time parameter this gather's metadata."""
        with torch.no_grad():
            for index, param in enumerate(self.params):
                param.post_all_gather(self.sharded_params[index]._local_tensor, self.gathered(index, buffer),
                                      self.metadata[index], self.compute_dtype, out=unsharded_params[index])


def _shard_mesh(dp: DataParallelMesh) -> Any:
    """The 1-D mesh the hooks agree over (FSDP2's ``shard_mesh_from_root``): the data-parallel shard dimension."""
    if dp.mesh.ndim == 1:
        return dp.mesh
    names = dp.mesh.mesh_dim_names
    if not names:
        raise NotImplementedError(
            "parameters with all-gather hooks under HSDP need a mesh with dimension names (init_device_mesh(..., "
            "mesh_dim_names=(...)))"
        )
    return dp.mesh[names[-1]]

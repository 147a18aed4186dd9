"""FSDP2's fully_shard keywords, the parts that need no process group: mappings and argument errors.

Their behaviour in training, against FSDP2 itself, is tests/distributed/fsdp2_keyword_checks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from megatron_fsdp import MixedPrecisionPolicy, fully_shard
from megatron_fsdp.core.mixed_precision import cast_floating, resolve_mp_policy
from megatron_fsdp.core.shard_module import _root_modules
from megatron_fsdp.core.validation import (
    check_ignored_params,
    check_shard_placement,
    resolve_dp_mesh_dims,
    resolve_reshard_after_forward,
)

TorchMP = torch_fsdp.MixedPrecisionPolicy
DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
needs_dims = pytest.mark.skipif(DataParallelMeshDims is None, reason="this torch has no DataParallelMeshDims")


def test_fsdp2_policy_maps_with_fsdp2s_meaning() -> None:
    ours = resolve_mp_policy(TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     output_dtype=torch.float16, cast_forward_inputs=False))
    assert ours == MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=None, main_grads_dtype=None,
                                        grad_comm_dtype=torch.float32, cast_forward_inputs=False,
                                        output_dtype=torch.float16)
    # reduce_dtype None reduces in param_dtype (FSDP2), not in the main gradients' dtype
    assert resolve_mp_policy(TorchMP(param_dtype=torch.bfloat16)).dtypes_for(torch.float32) == (
        torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    # FSDP2's default policy is our "every parameter keeps its dtype"
    assert resolve_mp_policy(TorchMP()).dtypes_for(torch.float32) == (torch.float32,) * 4
    assert resolve_mp_policy(None) is None


def test_other_policies_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="mp_policy must be a megatron_fsdp.MixedPrecisionPolicy or a torch"):
        resolve_mp_policy(torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16))  # FSDP1's
    with pytest.raises(ValueError, match="output_dtype=torch.int32"):
        MixedPrecisionPolicy(output_dtype=torch.int32)
    with pytest.raises(TypeError, match="cast_forward_inputs"):
        MixedPrecisionPolicy(cast_forward_inputs=1)


def test_casts_touch_floating_tensors_only() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    ids = torch.arange(3)
    (x, (y, n)), kwargs = policy.cast_inputs((torch.ones(2), (torch.ones(2, dtype=torch.float64), ids)),
                                             {"mask": torch.ones(2, dtype=torch.bool)})
    assert (x.dtype, y.dtype, n is ids, kwargs["mask"].dtype) == (torch.bfloat16, torch.bfloat16, True, torch.bool)
    out = policy.cast_outputs({"logits": torch.ones(2, dtype=torch.bfloat16), "ids": ids})
    assert out["logits"].dtype == torch.float32 and out["ids"] is ids
    kept = torch.ones(2)
    assert cast_floating([kept], torch.float32)[0] is kept  # already that dtype: no copy
    off = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    assert off.cast_inputs((kept,), {})[0][0] is kept
    assert MixedPrecisionPolicy().cast_outputs(kept) is kept


def test_reshard_after_forward_none_is_true_and_int_is_not_built() -> None:
    assert resolve_reshard_after_forward(None) is True
    assert resolve_reshard_after_forward(False) is False
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2"):
        resolve_reshard_after_forward(2)
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
        resolve_reshard_after_forward("yes")


def test_shard_placement_fn_takes_dim0_only() -> None:
    named = [("w", nn.Parameter(torch.ones(4, 3))), ("b", nn.Parameter(torch.ones(4)))]
    check_shard_placement(None, named)
    check_shard_placement(lambda p: None, named)
    check_shard_placement(lambda p: Shard(0), named)
    check_shard_placement(lambda p: Shard(-p.dim()), named)  # dim 0 counted from the end
    with pytest.raises(NotImplementedError, match=r"Shard\(1\) for parameter 'w' \(shape \(4, 3\)\)"):
        check_shard_placement(lambda p: Shard(1) if p.dim() == 2 else None, named)
    with pytest.raises(TypeError, match="returned Replicate\\(\\) for parameter 'w'"):
        check_shard_placement(lambda p: Replicate(), named)
    with pytest.raises(TypeError, match="shard_placement_fn must be callable"):
        check_shard_placement(Shard(0), named)


def test_ignored_params_must_be_parameters() -> None:
    p = nn.Parameter(torch.ones(2))
    assert check_ignored_params({p}) == {id(p)}
    assert check_ignored_params(None) == set()
    with pytest.raises(TypeError, match="ignored_params must be a set of nn.Parameter"):
        check_ignored_params(p)
    with pytest.raises(TypeError, match="ignored_params must be a set of nn.Parameter"):
        check_ignored_params(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="ignored_params holds a Tensor"):
        check_ignored_params([torch.ones(2)])


@needs_dims
def test_dp_mesh_dims_map_onto_our_dimension_names() -> None:
    assert resolve_dp_mesh_dims(DataParallelMeshDims(shard="dp"), None, None) == ("dp", None)
    assert resolve_dp_mesh_dims(DataParallelMeshDims(shard=("dp",), replicate="rep"), None, None) == ("dp", "rep")
    assert resolve_dp_mesh_dims(None, "a", "b") == ("a", "b")
    with pytest.raises(ValueError, match="dp_mesh_dims or dp_shard_dim/dp_outer_dim, not both"):
        resolve_dp_mesh_dims(DataParallelMeshDims(shard="dp"), "dp", None)
    with pytest.raises(NotImplementedError, match="flattening several mesh dimensions"):
        resolve_dp_mesh_dims(DataParallelMeshDims(shard=("a", "b")), None, None)
    with pytest.raises(NotImplementedError, match="no shard dimension"):
        resolve_dp_mesh_dims(DataParallelMeshDims(replicate="rep"), None, None)
    with pytest.raises(TypeError, match="dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims"):
        resolve_dp_mesh_dims({"shard": "dp"}, None, None)


def test_list_of_modules_is_validated() -> None:
    outer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert _root_modules([outer, outer[0]]) == [outer]  # a listed module inside another: FSDP2's root modules
    assert _root_modules([outer[0], outer[1], outer[0]]) == [outer[0], outer[1]]
    with pytest.raises(ValueError, match="empty list"):
        _root_modules([])
    with pytest.raises(TypeError, match=r"modules\[1\] is a Tensor"):
        _root_modules([outer, torch.ones(1)])
    with pytest.raises(ValueError, match="does not take a ModuleList"):
        _root_modules(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(TypeError, match="an nn.Module or a list of nn.Module"):
        _root_modules("model")


def test_unknown_keywords_are_named() -> None:
    with pytest.raises(TypeError, match="'reshard_after_fwd' \\(did you mean 'reshard_after_forward'\\?\\)"):
        fully_shard(nn.Linear(2, 2), reshard_after_fwd=True)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for name, value in (("ignored_params", set()), ("shard_placement_fn", lambda p: None)):
        with pytest.raises(TypeError, match=f"{name}= belongs to the per-module form"):
            fully_shard(nn.Linear(2, 2), optimizer, **{name: value})


def test_fsdp2_policies_import_from_megatron_fsdp():
    """FSDP2 users import the policies from where they import fully_shard (issue 25): torch's classes."""
    import torch.distributed.fsdp as torch_fsdp

    from megatron_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    assert CPUOffloadPolicy is torch_fsdp.CPUOffloadPolicy and OffloadPolicy is torch_fsdp.OffloadPolicy
    assert MixedPrecisionPolicy(param_dtype=None).param_dtype is None  # ours; it also takes torch's (from_fsdp2)

"""fully_shard_model's option handling that needs no process group: names, rejections, unit classes, docs."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import pytest
import torch
from torch import nn

from megatron_fsdp.api.config import DDP_CONFIG_STATUS, DistributedDataParallelConfig, check_adapter_options
from megatron_fsdp.api.fully_shard_model import (
    _REJECTED,
    FULLY_SHARD_MODEL_OPTIONS,
    MegatronPrecisionPolicy,
    fully_shard_model,
    precision_policy,
    resolve_unit_modules,
)
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.fully_shard import fully_shard
from tests import ROOT

DOCS = os.path.join(ROOT, "docs", "options.md")

# Every option the reference README (shared/seeds/003) names for fully_shard_model / fully_shard.
README_OPTIONS = (
    "fsdp_unit_modules", "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group",
    "expt_device_mesh", "zero_dp_strategy", "outer_dp_sharding_strategy", "init_model_with_meta_device",
    "grad_reduce_in_fp32", "preserve_fp32_weights", "overlap_grad_reduce", "overlap_param_gather",
    "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt", "enable_fine_grained_param_gather",
    "keep_fp8_transpose_cache", "nccl_ub", "fsdp_manual_registration", "disable_symmetric_registration",
    "fsdp_double_buffer", "device",
)


def test_every_readme_option_is_accepted() -> None:
    missing = [name for name in README_OPTIONS if name not in FULLY_SHARD_MODEL_OPTIONS]
    assert not missing, missing


def test_every_option_is_documented_with_a_status() -> None:
    with open(DOCS) as f:
        text = f.read()
    text = text[: text.index("## The Megatron adapter")]  # fully_shard_model's table only
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\| \*\*(\w+)", text, flags=re.M))
    assert set(rows) == set(FULLY_SHARD_MODEL_OPTIONS), set(rows) ^ set(FULLY_SHARD_MODEL_OPTIONS)
    assert set(rows.values()) <= {"implemented", "mapped", "rejected", "validated", "native"}, set(rows.values())
    for name in _REJECTED:
        assert rows[name] == "rejected", name


@pytest.mark.parametrize("name", sorted(_REJECTED))
def test_rejected_option_says_why(name: str) -> None:
    with pytest.raises(NotImplementedError) as info:
        fully_shard_model(nn.Linear(2, 2), **{name: True})
    message = str(info.value)
    assert f"{name}=True" in message and _REJECTED[name] in message
    assert len(_REJECTED[name]) > 60, "the reason must say why, not just 'unsupported'"


def test_rejected_options_off_are_not_an_error_before_the_mesh() -> None:
    # With every rejected option False the call proceeds to the mesh (which needs torch.distributed).
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard_model(nn.Linear(2, 2), **{name: False for name in _REJECTED})


def test_expert_mesh_must_be_a_mesh() -> None:
    with pytest.raises(TypeError, match="expt_device_mesh must be a DeviceMesh"):
        fully_shard_model(nn.Linear(2, 2), expt_device_mesh=object())


def test_unknown_option_is_named_with_suggestion_and_valid_list() -> None:
    with pytest.raises(TypeError) as info:
        fully_shard_model(nn.Linear(2, 2), overlap_grad_reduc=True)
    message = str(info.value)
    assert "'overlap_grad_reduc' (did you mean 'overlap_grad_reduce'?)" in message
    assert "valid options:" in message and "zero_dp_strategy" in message and "nccl_ub" in message


def test_flags_must_be_bool() -> None:
    with pytest.raises(TypeError, match="grad_reduce_in_fp32 must be True or False"):
        fully_shard_model(nn.Linear(2, 2), grad_reduce_in_fp32="yes")


def test_unit_module_resolution() -> None:
    assert resolve_unit_modules([nn.Linear, "torch.nn.LayerNorm"]) == (nn.Linear, nn.LayerNorm)
    assert resolve_unit_modules(nn.Linear) == (nn.Linear,)
    assert resolve_unit_modules(None) == ()
    with pytest.raises(ValueError, match="'torch.nn.NoSuchLayer'.*has no attribute 'NoSuchLayer'"):
        resolve_unit_modules(["torch.nn.NoSuchLayer"])
    with pytest.raises(ValueError, match="'nopkg_xyz.Layer': cannot import module 'nopkg_xyz'"):
        resolve_unit_modules(["nopkg_xyz.Layer"])
    with pytest.raises(ValueError, match="'Linear' is not an import path"):
        resolve_unit_modules(["Linear"])
    with pytest.raises(TypeError, match="'torch.cat' is not an nn.Module subclass"):
        resolve_unit_modules(["torch.cat"])
    # Errors name the entry before any process group is needed.
    with pytest.raises(ValueError, match="'torch.nn.NoSuchLayer'"):
        fully_shard_model(nn.Linear(2, 2), fsdp_unit_modules=["torch.nn.NoSuchLayer"])


def test_precision_flags_map_to_policy() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    default = precision_policy(preserve_fp32_weights=True, grad_reduce_in_fp32=False)
    assert isinstance(default, MixedPrecisionPolicy) and isinstance(default, MegatronPrecisionPolicy)
    # (compute, main, main grad, grad comm) for a bf16-built parameter
    assert default.dtypes_for(bf16) == (bf16, fp32, fp32, bf16)
    assert default.dtypes_for(fp32) == (fp32, fp32, fp32, fp32)
    assert precision_policy(preserve_fp32_weights=True, grad_reduce_in_fp32=True).dtypes_for(bf16) == (
        bf16, fp32, fp32, fp32)
    assert precision_policy(preserve_fp32_weights=False, grad_reduce_in_fp32=False).dtypes_for(bf16) == (
        bf16, bf16, bf16, bf16)
    assert default.dtypes_for(torch.int64) == (torch.int64,) * 4


def test_fully_shard_dispatch_errors_before_any_process_group() -> None:
    # A whole-model keyword selects the whole-model form; its unknown options are named with both forms' names.
    with pytest.raises(TypeError, match=r"'zero_stratgy' \(did you mean 'zero_dp_strategy'\?\).*sharding_strategy"):
        fully_shard(nn.Linear(2, 2), zero_stratgy=3)
    # A typo of a per-module keyword is caught the same way instead of silently switching forms.
    with pytest.raises(TypeError, match=r"'reshard_after_forwrd' \(did you mean 'reshard_after_forward'\?\)"):
        fully_shard(nn.Linear(2, 2), reshard_after_forwrd=False)
    with pytest.raises(TypeError, match="second argument must be a torch.optim.Optimizer"):
        fully_shard(nn.Linear(2, 2), "adam")
    with pytest.raises(TypeError, match=r"mesh= belongs to the per-module form \(use device_mesh=...\)"):
        fully_shard(nn.Linear(2, 2), mesh=object(), fsdp_unit_modules=[nn.Linear])


# -- the Megatron adapter's DistributedDataParallelConfig (issue 11 item 5) ------------------------

NO_EFFECT_VALUES = {"bucket_size": 1 << 20, "suggested_communication_unit_size": 1 << 24,
                    "pad_buckets_for_high_nccl_busbw": True, "gradient_reduce_div_fusion": False}


def test_every_ddp_config_field_has_a_status_in_code_and_docs() -> None:
    names = [f.name for f in dataclasses.fields(DistributedDataParallelConfig)]
    assert set(DDP_CONFIG_STATUS) == set(names), set(DDP_CONFIG_STATUS) ^ set(names)
    with open(DOCS) as f:
        text = f.read()
    section = text[text.index("## The Megatron adapter"):]
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\| \*\*([\w ]+)\*\*", section, flags=re.M))
    assert set(rows) >= set(names), set(names) - set(rows)
    for name in names:
        assert rows[name] == DDP_CONFIG_STATUS[name][0], (name, rows[name], DDP_CONFIG_STATUS[name][0])
    no_effect = {n for n, (status, _) in DDP_CONFIG_STATUS.items() if status == "no effect"}
    assert no_effect == set(NO_EFFECT_VALUES) | {"align_param_gather"}, no_effect


def test_ddp_config_defaults_pass_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_adapter_options(DistributedDataParallelConfig(use_megatron_fsdp=True))
        # Megatron-LM turns align_param_gather on by default: accepted without a warning.
        check_adapter_options(DistributedDataParallelConfig(use_megatron_fsdp=True, align_param_gather=True))


# What a valid (Megatron-FSDP) combination of each FP8 field needs: FP8 parameters are ZeRO-3 only, and
# the transpose cache and the MXFP8 buffer reuse exist only for them.
FP8_VALID = {
    "fp8_param_gather": {"data_parallel_sharding_strategy": "optim_grads_params"},
    "keep_fp8_transpose_cache": {"data_parallel_sharding_strategy": "optim_grads_params", "fp8_param_gather": True},
    "reuse_grad_buf_for_mxfp8_param_ag": {"data_parallel_sharding_strategy": "optim_grads_params",
                                          "fp8_param_gather": True},
}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_fp8_param_gather_is_zero3_only(strategy: str) -> None:
    with pytest.raises(ValueError, match=r"fp8_param_gather=True needs data_parallel_sharding_strategy="
                                         rf"'optim_grads_params' \(FP8 parameters are ZeRO-3 only in Megatron-FSDP\), "
                                         rf"got '{strategy}'"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, fp8_param_gather=True,
                                      data_parallel_sharding_strategy=strategy)


@pytest.mark.parametrize("name", ["keep_fp8_transpose_cache", "reuse_grad_buf_for_mxfp8_param_ag"])
def test_fp8_parameter_options_need_fp8_param_gather(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}=True applies to FP8 parameters only: it needs fp8_param_gather"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                      **{name: True})


def test_fp8_param_gather_valid_combination_is_rejected_naming_every_field() -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, keep_fp8_transpose_cache=True,
                                           **FP8_VALID["keep_fp8_transpose_cache"])
    with pytest.raises(NotImplementedError) as info:
        check_adapter_options(config)
    message = str(info.value)
    for name in ("fp8_param_gather", "keep_fp8_transpose_cache"):
        assert f"DistributedDataParallelConfig.{name}=True is not supported: {DDP_CONFIG_STATUS[name][1]}" in message


def test_keep_fp8_transpose_cache_is_zero3_only_in_fully_shard_model() -> None:
    for strategy in (0, 1, 2, "optim", "optim_grads", "no_shard"):
        with pytest.raises(ValueError, match=r"\(keep_fp8_transpose_cache=True\): FP8 parameters are ZeRO-3 only"):
            fully_shard_model(nn.Linear(2, 2), keep_fp8_transpose_cache=True, zero_dp_strategy=strategy)


@pytest.mark.parametrize("name", sorted(n for n, (s, _) in DDP_CONFIG_STATUS.items() if s == "rejected"))
def test_rejected_ddp_config_field_raises_naming_it(name: str) -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, **{**FP8_VALID.get(name, {}), name: True})
    with pytest.raises(NotImplementedError, match=rf"DistributedDataParallelConfig\.{name}=True is not supported"):
        check_adapter_options(config)


@pytest.mark.parametrize("name", sorted(NO_EFFECT_VALUES))
def test_no_effect_ddp_config_field_warns_with_the_reason(name: str) -> None:
    value = NO_EFFECT_VALUES[name]
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, **{name: value})
    with pytest.warns(UserWarning, match=rf"{name}={value!r} has no effect with megatron_fsdp: ") as caught:
        check_adapter_options(config)
    assert DDP_CONFIG_STATUS[name][1] in str(caught[0].message)


def test_distributed_optimizer_with_no_shard_warns() -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True)
    with pytest.warns(UserWarning, match="optimizer state stays replicated"):
        check_adapter_options(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_adapter_options(DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim"))

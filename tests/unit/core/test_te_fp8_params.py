"""TransformerEngine FP8 parameters (``quantized_model_init``, Megatron's ``--fp8-param-gather``) under fully_shard.

Not supported yet (docs/mixed_precision.md, "TransformerEngine FP8 parameters"): fully_shard refuses
them at once, naming the class and what to use instead. On CPU the refusal is checked with a class
that has TE's module path and FSDP2's hooks; the real TE classes need TransformerEngine on CUDA
(skipped here, listed in docs/gpu.md's first checks; never run so far).
"""

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard


class Float8Tensor(torch.Tensor):
    """A tensor subclass with FSDP2's hooks, defined as if in TransformerEngine (its module path)."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):  # noqa: ANN001, ANN201
        raise AssertionError("fully_shard must refuse the class before any gather")

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):  # noqa: ANN001, ANN201
        raise AssertionError("fully_shard must refuse the class before any gather")


Float8Tensor.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


def test_transformer_engine_quantized_parameters_are_refused_naming_the_class(gloo_rank) -> None:
    layer = nn.Linear(8, 8)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Float8Tensor))
    assert type(layer.weight) is Float8Tensor
    with pytest.raises(NotImplementedError, match=r"TransformerEngine's quantized parameter class Float8Tensor .* "
                                                  r"quantized_model_init .*gather_format='mxfp8'"):
        fully_shard(layer)


def _te_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (TransformerEngine FP8 parameters)")
    return pytest.importorskip("transformer_engine.pytorch", reason="needs TransformerEngine (CUDA)")


@pytest.mark.parametrize("recipe_name", ["Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling"])
def test_real_transformer_engine_fp8_parameters_are_refused(nccl_group, recipe_name: str) -> None:
    """UNVERIFIED (never run: no GPU with TransformerEngine so far). TE's Float8Tensor / MXFP8Tensor parameters
    from quantized_model_init are refused by fully_shard with the message above."""
    te = _te_on_cuda()
    from transformer_engine.common import recipe as te_recipe

    if recipe_name == "MXFP8BlockScaling" and torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("MXFP8 parameters need a Blackwell GPU (sm_100+)")
    recipe = getattr(te_recipe, recipe_name)()
    init = getattr(te, "quantized_model_init", None) or te.fp8_model_init  # TE 2.x's name, older TE's
    with init(enabled=True, recipe=recipe):
        layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    assert type(layer.weight).__module__.startswith("transformer_engine"), type(layer.weight)
    with pytest.raises(NotImplementedError, match="TransformerEngine's quantized parameter class"):
        fully_shard(layer)

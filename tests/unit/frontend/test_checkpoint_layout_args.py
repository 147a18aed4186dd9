"""--load across tensor-parallel sizes: the padded vocabulary must agree, and the error says why it does not."""

from __future__ import annotations

import argparse

import pytest

from megatron.training.checkpointing import _check_extra, model_args_mismatch

SAVED = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 60, "padded_vocab_size": 256,
         "tensor_model_parallel_size": 2}


def _args(**overrides) -> argparse.Namespace:
    values = {**SAVED, "tensor_model_parallel_size": 1, "padded_vocab_size": 128, "make_vocab_size_divisible_by": 128,
              "load": "ckpt", "finetune": False, "no_load_args_check": False, **overrides}
    return argparse.Namespace(**values)


def test_padding_changed_by_the_tp_size_is_explained():
    args = _args()
    assert model_args_mismatch(SAVED, args) == ["--padded-vocab-size 256 (saved) vs 128 (now)"]
    with pytest.raises(ValueError) as info:
        _check_extra(args)({"args": SAVED})
    message = str(info.value)
    assert "--make-vocab-size-divisible-by x --tensor-model-parallel-size (128 x 2 when saved, x 1 now)" in message
    assert "choose --make-vocab-size-divisible-by so that both layouts pad to the same size" in message


def test_same_padding_at_another_tp_size_is_accepted():
    saved = {**SAVED, "padded_vocab_size": 64}
    args = _args(padded_vocab_size=64, make_vocab_size_divisible_by=32)
    assert model_args_mismatch(saved, args) == []
    _check_extra(args)({"args": saved, "scheduler": {}, "consumed_train_samples": 0, "consumed_valid_samples": 0})


def test_other_changes_get_no_padding_hint():
    args = _args(tensor_model_parallel_size=2, padded_vocab_size=256, hidden_size=64)
    with pytest.raises(ValueError) as info:
        _check_extra(args)({"args": SAVED})
    assert "--hidden-size 32 (saved) vs 64 (now)" in str(info.value)
    assert "padded rows" not in str(info.value)


def test_a_strict_mismatch_is_worded_for_the_command_line():
    """--no-load-args-check with other shapes: the library's "Pass strict=False" is no flag (issue 25)."""
    from megatron.training.checkpointing import _mismatch_message
    from megatron_fsdp.checkpoint.state_dicts import CheckpointMismatchError, KeyReport, settle

    report = KeyReport(mismatched_keys=["model.embedding.weight: checkpoint (256, 32), model (128, 32)"])
    with pytest.raises(CheckpointMismatchError) as info:
        settle(report, strict=True, where="model state")
    assert info.value.report is report and "strict=False" in str(info.value)  # the library's own advice
    for flags, expected in ((dict(no_load_args_check=True), "--finetune or --no-load-args-check let model "
                             "arguments differ from the saved ones, but every tensor of the model must still be"),
                            ({}, "this model's tensors are not the checkpoint's")):
        message = _mismatch_message(_args(**flags), info.value)
        assert "strict=False" not in message, message
        assert message.startswith("--load ckpt: checkpoint model state does not match: ") and expected in message
        assert "model.embedding.weight: checkpoint (256, 32), model (128, 32)" in message
        assert "Pass the model arguments the checkpoint was saved with" in message


def test_a_strict_mismatch_is_a_usage_error_and_still_the_librarys():
    """pretrain_gpt.py prints a UsageError once without a traceback; code catching the library's type still works."""
    from megatron.training.checkpointing import LoadMismatchError
    from megatron.training.errors import UsageError
    from megatron_fsdp.checkpoint.state_dicts import CheckpointMismatchError

    assert issubclass(LoadMismatchError, UsageError) and issubclass(LoadMismatchError, CheckpointMismatchError)

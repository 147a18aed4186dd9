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

"""pretrain_gpt.py flags: Megatron names, derived values and Megatron-style rejections."""

from __future__ import annotations

import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.logging_utils import training_log_line, validation_log_lines
from megatron.training.model_setup import ddp_config_from_args

BASE = ["--mock-data", "--vocab-size", "64"]


def args_for(*flags: str, world_size: int = 2):
    return validate_args(parse_args([*BASE, *flags]), world_size)


def test_derived_values():
    args = args_for("--micro-batch-size", "2", "--global-batch-size", "16", "--hidden-size", "48",
                    "--seq-length", "40", world_size=4)
    assert args.num_microbatches == 2 and args.data_parallel_size == 4
    assert args.ffn_hidden_size == 192 and args.max_position_embeddings == 40 and args.lr_decay_iters == 20
    assert args_for("--micro-batch-size", "3").global_batch_size == 6  # default: one micro-batch per rank


@pytest.mark.parametrize("flags, message", [
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor requires --use-megatron-fsdp"),
    (["--data-parallel-sharding-strategy", "optim"], "--data-parallel-sharding-strategy requires --use-megatron-fsdp"),
    (["--init-model-with-meta-device"], "--init-model-with-meta-device requires --use-megatron-fsdp"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], "--global-batch-size (6) must be divisible by"),
    (["--use-megatron-fsdp", "--save", "/tmp/x"], "Megatron-FSDP only supports the fsdp_dtensor checkpoint format"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "3"],
     "--num-distributed-optimizer-instances (3) must divide the data-parallel size (2)"),
    (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"],
     "--outer-dp-sharding-strategy optim requires --num-distributed-optimizer-instances > 1"),
    (["--use-megatron-fsdp", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 requires --bf16"),
    (["--use-megatron-fsdp", "--use-nccl-ub"], "--use-nccl-ub is not supported by megatron_fsdp"),
    (["--use-megatron-fsdp", "--fsdp-double-buffer"], "--fsdp-double-buffer is not supported by megatron_fsdp"),
    (["--seq-length", "80", "--max-position-embeddings", "64"], "--seq-length (80) must be <= "),
    (["--fp16"], "use --bf16"),
    (["--use-megatron-fsdp", "--model-provider", "mcore", "--distributed-backend", "gloo"],
     "--model-provider mcore needs CUDA"),
    (["--save-interval", "5"], "--save-interval requires --save"),
    (["--use-distributed-optimizer"], "add --use-megatron-fsdp --data-parallel-sharding-strategy optim"),
])
def test_rejections(flags, message):
    with pytest.raises(ArgumentError, match=None) as info:
        args_for(*flags)
    assert message in str(info.value), str(info.value)


def test_needs_data():
    with pytest.raises(ArgumentError, match="--data-path PREFIX"):
        validate_args(parse_args(["--vocab-size", "8"]), 1)


def test_bad_choice_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--data-parallel-sharding-strategy", "zero3"])
    assert "--data-parallel-sharding-strategy" in capsys.readouterr().err


def test_ddp_config_mapping():
    args = args_for("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--bf16",
                    "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce", world_size=4)
    config = ddp_config_from_args(args)
    assert config.use_megatron_fsdp and config.data_parallel_sharding_strategy == "optim_grads_params"
    assert config.grad_reduce_in_fp32 and config.num_distributed_optimizer_instances == 2
    assert config.overlap_grad_reduce and not config.overlap_param_gather
    args = args_for("--use-megatron-fsdp", "--bf16", "--grad-reduce-in-bf16")
    assert not ddp_config_from_args(args).grad_reduce_in_fp32


def test_log_line_format():
    line = training_log_line(iteration=10, train_iters=20, consumed=80, elapsed_ms=12.34, tflops=1.25, lr=3e-4,
                             global_batch=8, losses={"lm loss": 1.2345678}, grad_norm=0.5, skipped=0, nan=0)
    assert line.startswith(" [") and "] iteration       10/      20 |" in line
    for part in ("consumed samples:           80 |", "elapsed time per iteration (ms): 12.3 |",
                 "throughput per GPU (TFLOP/s/GPU): 1.2 |", "learning rate: 3.000000E-04 |",
                 "global batch size:     8 |", "lm loss: 1.234568E+00 |", "grad norm: 0.500 |",
                 "number of skipped iterations:   0 |", "number of nan iterations:   0 |"):
        assert part in line, part
    assert "lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00" in validation_log_lines(5, 2.0)

"""pretrain_gpt.py flags: Megatron names, derived values and Megatron-style rejections."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.logging_utils import format_tflops, training_log_line, validation_log_lines
from tests import ROOT
from tests.unit.test_without_megatron_core import blocked_env


def ddp_config_from_args(args):
    """model_setup's (imported here, not at the top: test_without_megatron_core_start_up_stops_naming_how_to_get_it
    imports this module where megatron-core is blocked, and model_setup imports megatron-core's scheduler)."""
    from megatron.training.model_setup import ddp_config_from_args as from_args

    return from_args(args)

BASE = ["--mock-data", "--vocab-size", "64"]


def args_for(*flags: str, world_size: int = 2):
    return validate_args(parse_args([*BASE, *flags]), world_size)


def test_derived_values():
    args = args_for("--micro-batch-size", "2", "--global-batch-size", "16", "--hidden-size", "48",
                    "--seq-length", "40", world_size=4)
    assert args.data_parallel_size == 4
    from megatron.training.config import init_num_microbatches  # megatron-core's (see ddp_config_from_args)

    assert init_num_microbatches(args) == 2  # megatron-core's calculator: 16 / (2 x 4)
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
    (["--use-megatron-fsdp", "--use-nccl-ub"], "--use-nccl-ub is not supported by this front-end"),
    (["--use-nccl-ub"], "--use-nccl-ub is not supported by this front-end"),  # not ignored by the DDP baseline
    (["--bf16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 (the DDP baseline reduces its fp32 gradients"),
    (["--use-megatron-fsdp", "--fsdp-double-buffer"], "--fsdp-double-buffer is not supported by megatron_fsdp"),
    (["--seq-length", "80", "--max-position-embeddings", "64"], "--seq-length (80) must be <= "),
    (["--fp16"], "use --bf16"),
    (["--use-distributed-optimizer"], "add --use-megatron-fsdp --data-parallel-sharding-strategy optim"),
])
def test_rejections(flags, message):
    with pytest.raises(ArgumentError, match=None) as info:
        args_for(*flags)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("flags, message", [
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive, got 0"),
    (["--ffn-hidden-size", "-1"], "--ffn-hidden-size must be positive, got -1"),
    (["--num-query-groups", "0"], "--num-query-groups must be positive, got 0"),
    (["--init-method-std", "-0.02"], "--init-method-std must be a finite number > 0"),
    (["--init-method-std", "nan"], "--init-method-std must be a finite number > 0"),
    (["--attention-dropout", "1.5"], "--attention-dropout must be in [0, 1), got 1.5"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1), got -0.1"),
    (["--hidden-dropout", "1"], "--hidden-dropout must be in [0, 1), got 1.0"),
    (["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1)"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0 (0: no clipping), got -1.0"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
    (["--adam-eps=-1e-8"], "--adam-eps must be a finite number >= 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be positive, got 0"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings must be positive"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be positive"),
    (["--vocab-size", "0"], "--vocab-size must be positive"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
    (["--eval-iters", "0", "--eval-interval", "5"], "--eval-iters 0 with --eval-interval evaluates nothing"),
    (["--eval-interval", "0"], "--eval-interval must be positive, got 0"),
    (["--lr-warmup-iters", "-2"], "--lr-warmup-iters must be >= 0"),
    (["--lr-warmup-iters", "20"], "--lr-warmup-iters (20) must be < --lr-decay-iters (20"),
    (["--lr-warmup-iters", "20", "--lr-decay-style", "constant"],
     "--lr-warmup-iters (20) must be < --lr-decay-iters (20, default --train-iters), for every --lr-decay-style"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be positive"),
    (["--exit-interval", "0"], "--exit-interval must be positive"),
    (["--num-workers", "-1"], "--num-workers must be >= 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be positive"),
    (["--split", "90,x"], "--split '90,x' is not valid"),
    (["--rotary-base", "0"], "--rotary-base must be positive"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer"],
     "--use-distributed-optimizer with --use-megatron-fsdp and --data-parallel-sharding-strategy no_shard"),
])
def test_numeric_and_range_rejections(flags, message):
    """Each out-of-range value is rejected naming its flag, not replaced nor left to a torch error."""
    with pytest.raises(ArgumentError) as info:
        args_for(*flags)
    assert message in str(info.value), str(info.value)


def test_accepted_edges():
    args = args_for("--clip-grad", "0", "--lr", "0", "--min-lr", "0", "--attention-dropout", "0",
                    "--lr-warmup-iters", "19", "--lr-decay-style", "constant", "--eval-iters", "0")
    assert args.clip_grad == 0 and args.lr == 0
    fsdp = args_for("--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim")
    assert ddp_config_from_args(fsdp).use_distributed_optimizer


def test_nan_check_on_by_default_and_timeout_flag():
    assert args_for().check_for_nan_in_loss_and_grad
    assert args_for("--check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad
    assert not args_for("--no-check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad
    assert args_for().distributed_timeout_minutes == 10
    assert args_for("--distributed-timeout-minutes", "3").distributed_timeout_minutes == 3


def test_without_megatron_core_start_up_stops_naming_how_to_get_it():
    """megatron-core's GPTModel is the model: where megatron-core cannot be imported, validation stops saying how
    to install it (no other model is built). Run in a subprocess whose megatron.core import is blocked
    (tests/no_megatron_core/): megatron-core is installed here."""
    script = (
        "import pytest\n"
        "from megatron.training.arguments import ArgumentError\n"
        "from tests.unit.frontend.test_frontend_arguments import args_for\n"
        "from megatron.training.mcore_cpu_compat import MCORE_VERSION\n"
        "for flags in ((), ('--model-provider', 'mcore'), ('--model-provider', 'auto')):\n"
        "    with pytest.raises(ArgumentError) as info:\n"
        "        args_for(*flags)\n"
        "    message = str(info.value)\n"
        "    assert message.startswith(\"megatron-core's GPTModel (the model pretrain_gpt.py builds) cannot run \"\n"
        "                              'this here: megatron-core is not installed'), message\n"
        "    assert f'pip install megatron-core=={MCORE_VERSION}' in message and 'PYTHONPATH' not in message\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=blocked_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]


def test_model_provider_is_megatron_core_and_auto_is_its_synonym():
    """mcore (the default) and auto (the old default) both build megatron-core's GPTModel, also under context
    parallelism (the front-end's CP core attention, mcore_cp_attention.py)."""
    assert args_for().model_provider == "mcore"
    assert args_for("--model-provider", "auto").model_provider == "mcore"
    assert args_for("--model-provider", "mcore", "--context-parallel-size", "2", world_size=4).model_provider == "mcore"


@pytest.mark.parametrize("value,message", [
    ("gpt", "argument --model-provider: --model-provider gpt: the project's own GPT (megatron/training/gpt_model.py) "
            "was removed; megatron-core's GPTModel is the model. Pass --model-provider mcore (the default) or "
            "leave the flag out"),
    ("own", "argument --model-provider: --model-provider 'own': valid values are mcore (the default) and auto"),
])
def test_model_provider_gpt_is_a_usage_error_at_parse_time(capsys, value, message):
    with pytest.raises(SystemExit) as info:
        parse_args([*BASE, "--model-provider", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err, err


BIASES = ("--num-experts with biases: megatron-core 0.16.1's experts add their output bias in place on a view autograd "
          "refuses at the first forward (pass --disable-bias-linear)")
GELU = ("--num-experts with GeLU experts: megatron-core fuses the bias-GeLU only without the router's per-token "
        "probabilities (pass --no-bias-gelu-fusion")


@pytest.mark.parametrize("flags,causes,runs_with", [
    (["--num-experts", "2"], [BIASES, GELU], ["--disable-bias-linear", "--no-bias-gelu-fusion"]),
    (["--num-experts", "2", "--disable-bias-linear"], [GELU], ["--no-bias-gelu-fusion"]),
    (["--num-experts", "2", "--no-bias-gelu-fusion"], [BIASES], ["--disable-bias-linear"]),
    (["--num-experts", "2", "--swiglu"], [BIASES], ["--disable-bias-linear"]),
])
def test_what_megatron_core_cannot_run_stops_naming_the_flag(flags, causes, runs_with):
    """No fallback: validation fails with every blocker's message, each naming the flag to change."""
    with pytest.raises(ArgumentError) as info:
        args_for(*flags)
    message = str(info.value)
    assert message.startswith("megatron-core's GPTModel (the model pretrain_gpt.py builds) cannot run this here: ")
    assert all(cause in message for cause in causes) and message.count("(pass --") == len(causes), message
    assert args_for(*flags, *runs_with).model_provider == "mcore"


def test_transformer_engine_asked_for_and_absent_stops_naming_the_flag():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed")
    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine needs TransformerEngine.*"
                                            "pass --transformer-impl local"):
        args_for("--transformer-impl", "transformer_engine")


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
    # a CPU rate keeps three significant digits instead of printing 0.0; GPU rates keep Megatron's one decimal
    assert [format_tflops(x) for x in (0.0, 0.004123, 0.5, 312.46)] == ["0.0", "0.00412", "0.5", "312.5"]


def test_tensor_parallel_sizes_and_derived_data_parallel_size(capsys):
    args = args_for("--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2",
                    world_size=4)
    assert args.data_parallel_size == 2 and args.global_batch_size == 4 and args.sequence_parallel
    args = args_for("--sequence-parallel", world_size=2)  # TP 1: nothing to split, disabled as Megatron does
    assert not args.sequence_parallel and "--sequence-parallel has no effect" in capsys.readouterr().out
    from megatron.training.model_setup import pad_vocab_size

    padded = pad_vocab_size(args_for("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "16",
                                     "--vocab-size", "40", world_size=2))
    assert padded == 64  # a multiple of 16 x TP, so every TP rank holds an equal vocabulary slice


@pytest.mark.parametrize("flags, world, message", [
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size (3) must be >= 1 and divide"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "48"], 2,
     "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    (["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"], 2,
     "--num-query-groups (1) must be divisible"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33",
      "--max-position-embeddings", "40"], 2, "--seq-length (33) / --context-parallel-size (1) must be divisible"),
    (["--context-parallel-size", "3"], 4, "--context-parallel-size (3) must be >= 1, and"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--seq-length", "34",
      "--max-position-embeddings", "40"], 4, "--seq-length (34) must be divisible by 2 x --context-parallel-size"),
    (["--pipeline-model-parallel-size", "2"], 4, "pipeline parallelism is not supported"),
])
def test_model_parallel_rejections(flags, world, message):
    with pytest.raises(ArgumentError) as error:
        args_for(*flags, world_size=world)
    assert message in str(error.value), str(error.value)

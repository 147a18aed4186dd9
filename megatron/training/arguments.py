"""Command-line arguments with Megatron-LM's flag names, defaults and validation rules.

``parse_args(argv)`` returns an ``argparse.Namespace`` whose attribute names are
Megatron's (``args.data_parallel_sharding_strategy`` ...). ``validate_args``
derives what Megatron derives (gradient-accumulation steps, FFN size, the
DDP config) and rejects combinations with Megatron-style messages; it needs the
data-parallel world size, so it runs after ``torch.distributed`` is up.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from megatron_fsdp.sharding.strategy import OUTER_STRATEGY_NAMES, STRATEGY_NAMES

from .errors import UsageValueError, print_once
from .initialize import print_rank_0
from .mcore_model import check_mcore_model
from .megatron_flags import (
    CKPT_FORMATS,
    LR_DECAY_STYLES,
    POSITION_EMBEDDING_TYPES,
    add_megatron_compat_args,
    default_transformer_impl,
    validate_megatron_compat_args,
)
from .moe_arguments import add_moe_args, validate_moe_args
from .tokenizer import TOKENIZER_TYPES, resolve_tokenizer_files

STRATEGIES = STRATEGY_NAMES


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-provider", type=model_provider_type, default="mcore", metavar="{mcore,auto}",
                   help="mcore (default): megatron-core's GPTModel, the only model (as Megatron-LM's "
                        "pretrain_gpt.py); auto: the same (the old default, kept for scripts that pass it); where "
                        "megatron-core cannot run the configuration, start-up stops naming each cause")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="grouped-query attention's key/value heads; read only with --group-query-attention "
                        "(as Megatron)")
    g.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups (default: heads)")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / mock data vocabulary size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch * data-parallel size")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--override-opt_param-scheduler", action="store_true", dest="override_opt_param_scheduler",
                   help="at --load: take the learning-rate schedule (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style) from these flags, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="at --load: take the learning-rate schedule from the checkpoint, ignoring these flags")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="not supported: use --bf16")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None, help="default: no evaluation")
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of the process group's collectives: how long a rank waits for a missing peer")
    g.add_argument("--deterministic-mode", action="store_true", help="torch.use_deterministic_algorithms(True)")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="NullTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)


def _model_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="Megatron-style tensor parallelism: attention heads, FFN width and vocabulary split "
                        "across this many ranks (consecutive ranks form a TP group)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor parallelism: split norms, dropout and residuals along the sequence")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism: the sequence split across this many ranks (load-balanced causal "
                        "split, exact attention by gathering keys and values); FSDP shards over DP x CP")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="only 1 is supported")


def _fsdp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed / megatron-fsdp")
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument("--use-custom-fsdp", action="store_true", help="deprecated alias of --use-megatron-fsdp")
    g.add_argument("--data-parallel-sharding-strategy", choices=STRATEGIES, default="no_shard")
    g.add_argument("--outer-dp-sharding-strategy", choices=OUTER_STRATEGY_NAMES, default="no_shard")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--ddp-average-in-collective", action="store_true")
    g.add_argument("--init-model-with-meta-device", action="store_true")
    g.add_argument("--fsdp-double-buffer", action="store_true")
    g.add_argument("--use-nccl-ub", action="store_true")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="(default) stop with an error at the first iteration whose loss or grad norm is NaN/Inf")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="skip such iterations instead (the run fails if all are skipped)")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--allow-fresh-start", action="store_true",
                   help="with --load: train from scratch when it names no checkpoint (default: an error)")
    g.add_argument("--no-load-args-check", action="store_true",
                   help="load a checkpoint saved with other model arguments (default: an error naming them)")
    g.add_argument("--exit-interval", type=int, default=None)


class _Parser(argparse.ArgumentParser):
    """argparse for a job every rank of which parses the same flags: rank 0 alone prints the usage and
    the error (every rank exits 2), and an unknown flag gets the nearest known one as a suggestion."""

    def error(self, message: str) -> NoReturn:
        message = _suggest(message, list(self._option_string_actions))
        error = f"{self.prog}: error: {message}\n"
        print_once(self.format_usage() + error, report=error)
        sys.exit(2)


_UNRECOGNIZED = "unrecognized arguments: "


def _suggest(message: str, known: list[str]) -> str:
    """argparse's message, with "did you mean" for each unrecognized flag that is close to a known one."""
    if not message.startswith(_UNRECOGNIZED):
        return message
    hints = []
    for token in message[len(_UNRECOGNIZED):].split():
        flag = token.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    return message + "".join(f"\n  {hint}" for hint in hints)


MODEL_PROVIDERS = ("mcore", "auto")


def model_provider_type(value: str) -> str:
    """``--model-provider``: ``mcore``, or ``auto`` (the old default) meaning the same; ``gpt`` is refused at
    parse time (the project's own GPT was removed)."""
    if value in MODEL_PROVIDERS:
        return "mcore"
    if value == "gpt":
        raise argparse.ArgumentTypeError(
            "--model-provider gpt: the project's own GPT (megatron/training/gpt_model.py) was removed; "
            "megatron-core's GPTModel is the model. Pass --model-provider mcore (the default) or leave the flag out")
    raise argparse.ArgumentTypeError(f"--model-provider {value!r}: valid values are mcore (the default) and auto "
                                     "(the same)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description="Megatron-style GPT pre-training on megatron_fsdp (see docs/megatron.md)",
        allow_abbrev=False,
    )
    for add in (_model_args, _training_args, _data_args, _model_parallel_args, add_moe_args, _fsdp_args,
                add_megatron_compat_args):
        add(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse Megatron-LM flags (no validation that needs the process group).

    ``args.argv_flags`` records the flags given, for defaults that depend on whether a flag was
    set explicitly (``--transformer-impl``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv_flags = tuple(a.split("=", 1)[0] for a in argv if a.startswith("--"))
    return args


class ArgumentError(UsageValueError):
    """A flag combination Megatron would reject (a ``ValueError``; printed once, without a traceback)."""


def _fail(message: str) -> None:
    raise ArgumentError(message)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive Megatron's computed arguments and reject invalid combinations (in place)."""
    args.world_size = world_size
    default_transformer_impl(args)
    check_mcore_model(args, _fail)
    _validate_model_parallel(args, world_size)
    if args.use_custom_fsdp:
        args.use_megatron_fsdp = True
    if args.fp16:
        _fail("--fp16 is not supported by this front-end; use --bf16")
    _validate_numbers(args)
    _validate_query_groups(args)
    validate_megatron_compat_args(args, _fail)
    resolve_tokenizer_files(args, lambda flag: flag in getattr(args, "argv_flags", ()), _fail)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) must be <= --max-position-embeddings "
              f"({args.max_position_embeddings})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _validate_tensor_parallel_sizes(args)
    if args.seq_length % (2 * args.context_parallel_size) and args.context_parallel_size > 1:
        _fail(f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size "
              f"({2 * args.context_parallel_size}): the load-balanced split cuts the sequence into that many chunks")
    _validate_batch(args)
    _validate_fsdp(args)
    validate_moe_args(args, world_size, _fail)
    _validate_data_and_checkpoints(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:  # Megatron: warmup steps = fraction x decay steps (a float)
        args.lr_warmup_iters = args.lr_warmup_fraction * args.lr_decay_iters
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.lr_warmup_iters >= args.lr_decay_iters:  # megatron-core's OptimizerParamScheduler asserts it
        _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < --lr-decay-iters ({args.lr_decay_iters}, "
              f"default --train-iters), for every --lr-decay-style (megatron-core's OptimizerParamScheduler "
              f"requires it; here --lr-decay-style {args.lr_decay_style})")
    args.params_dtype = "bfloat16" if args.bf16 else "float32"
    return args


# Flags checked by _validate_numbers, by the range their values must lie in.
_POSITIVE_INTS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                  "train_iters", "log_interval", "make_vocab_size_divisible_by", "rotary_base",
                  "distributed_timeout_minutes")
_OPTIONAL_POSITIVE_INTS = ("ffn_hidden_size", "num_query_groups", "max_position_embeddings", "global_batch_size",
                           "vocab_size", "lr_decay_iters", "eval_interval", "save_interval", "exit_interval")
_NON_NEGATIVE_INTS = ("eval_iters", "lr_warmup_iters", "num_workers")
_NON_NEGATIVE_FLOATS = ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad")
_PROBABILITIES = ("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _validate_numbers(args: argparse.Namespace) -> None:
    """Reject sizes <= 0, negative counts, probabilities outside [0, 1) and NaN/Inf, naming the flag.

    Torch would otherwise fail later with a message that names no flag (a negative
    std, a dropout of 1.5), or a value would be silently replaced (--ffn-hidden-size 0).
    """
    for dest in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        value = getattr(args, dest)
        if (value is not None or dest in _POSITIVE_INTS) and (value is None or value <= 0):
            _fail(f"{_flag(dest)} must be positive, got {value}")
    for dest in _NON_NEGATIVE_INTS:
        if getattr(args, dest) < 0:
            _fail(f"{_flag(dest)} must be >= 0, got {getattr(args, dest)}")
    for dest in _NON_NEGATIVE_FLOATS:
        value = getattr(args, dest)
        if not math.isfinite(value) or value < 0:
            hint = " (0: no clipping)" if dest == "clip_grad" else ""
            _fail(f"{_flag(dest)} must be a finite number >= 0{hint}, got {value}")
    if not (math.isfinite(args.init_method_std) and args.init_method_std > 0):
        _fail(f"--init-method-std must be a finite number > 0 (the std of the initial weights), "
              f"got {args.init_method_std}")
    for dest in _PROBABILITIES:
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:  # also false for NaN
            _fail(f"{_flag(dest)} must be in [0, 1), got {value}")
    if not 0 <= args.seed < 2**32:
        _fail(f"--seed must be in [0, 2**32) (numpy's seed range), got {args.seed}")
    if args.eval_interval is not None and args.eval_iters == 0:
        _fail("--eval-iters 0 with --eval-interval evaluates nothing; give --eval-iters > 0 or drop --eval-interval")
    try:
        parse_split(args.split)
    except ValueError as error:
        _fail(str(error))


_SPLIT_NUMBER = re.compile(r"^\s*\d+(\.\d*)?\s*$|^\s*\.\d+\s*$")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, 1 to 3 numbers, missing ones 0) as fractions summing to 1.

    The user-facing check of ``--split``: megatron-core's ``parse_and_normalize_split`` reads any
    digits it finds in the string (``"90,x"`` becomes ``90,0,0``) and asserts on the rest.
    """
    parts = re.split(r"[,/]", split) if isinstance(split, str) else None
    if not parts or len(parts) > 3 or not all(_SPLIT_NUMBER.match(p) for p in parts):
        raise ValueError(
            f"--split {split!r} is not valid: give 1 to 3 non-negative numbers separated by ',' or '/' "
            "(train,valid,test weights), e.g. \"969,30,1\""
        )
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0; at least one must be positive")
    total = sum(weights)
    return [w / total for w in weights]


def _validate_query_groups(args: argparse.Namespace) -> None:
    """Megatron reads --num-query-groups only with --group-query-attention; without it: every head its own group."""
    if args.num_query_groups is not None and not args.group_query_attention:
        print_rank_0(f"NOTE: --num-query-groups {args.num_query_groups} is ignored without --group-query-attention "
                     "(as in Megatron-LM): multi-head attention, one key/value head per query head")
        args.num_query_groups = None


def _validate_model_parallel(args: argparse.Namespace, world_size: int) -> None:
    """Tensor and context parallelism divide the world; what is not built (PP) is refused by name."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if tp < 1 or world_size % tp:
        _fail(f"--tensor-model-parallel-size ({tp}) must be >= 1 and divide the world size ({world_size})")
    if cp < 1 or world_size % (tp * cp):
        _fail(f"--context-parallel-size ({cp}) must be >= 1, and --tensor-model-parallel-size x "
              f"--context-parallel-size ({tp} x {cp}) must divide the world size ({world_size})")
    args.data_parallel_size = world_size // (tp * cp)
    if args.pipeline_model_parallel_size != 1:
        _fail(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: pipeline parallelism is not "
              "supported by this front-end; use 1")
    if args.sequence_parallel and tp == 1:
        print("WARNING: --sequence-parallel has no effect with --tensor-model-parallel-size 1 (disabled, as "
              "Megatron does)", flush=True)
        args.sequence_parallel = False


def _validate_tensor_parallel_sizes(args: argparse.Namespace) -> None:
    """Every split must divide, named by its flag (before a layer fails on a shape)."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return
    groups = args.num_query_groups or args.num_attention_heads
    for flag, value in (("--num-attention-heads", args.num_attention_heads), ("--num-query-groups", groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % tp:
            _fail(f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp})")
    if args.sequence_parallel and (args.seq_length // args.context_parallel_size) % tp:
        _fail(f"--seq-length ({args.seq_length}) / --context-parallel-size ({args.context_parallel_size}) must be "
              f"divisible by --tensor-model-parallel-size ({tp}) with --sequence-parallel")


def _validate_batch(args: argparse.Namespace) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
              f"({args.micro_batch_size}) times the data-parallel size ({args.data_parallel_size})")
    # the number of micro-batches comes from megatron-core's calculator (config.init_num_microbatches)


def _validate_fsdp(args: argparse.Namespace) -> None:
    instances = args.num_distributed_optimizer_instances
    if instances < 1 or args.data_parallel_size % instances:
        _fail(f"--num-distributed-optimizer-instances ({instances}) must divide the data-parallel size "
              f"({args.data_parallel_size})")
    if args.use_nccl_ub:  # in both modes: PyTorch DDP (the baseline) registers no user buffers either
        _fail("--use-nccl-ub is not supported by this front-end: NCCL user-buffer registration needs persistent "
              "registered buffers, and megatron_fsdp's are pooled per use (see docs/options.md); the DDP baseline "
              "(PyTorch DDP) has no user-buffer registration")
    if not args.use_megatron_fsdp:
        for flag, on in (("--data-parallel-sharding-strategy", args.data_parallel_sharding_strategy != "no_shard"),
                         ("--outer-dp-sharding-strategy", args.outer_dp_sharding_strategy != "no_shard"),
                         ("--init-model-with-meta-device", args.init_model_with_meta_device),
                         ("--fsdp-double-buffer", args.fsdp_double_buffer),
                         ("--grad-reduce-in-bf16 (the DDP baseline reduces its fp32 gradients in fp32)",
                          args.grad_reduce_in_bf16 and args.bf16 and not args.use_torch_fsdp2),
                         ("--ckpt-format fsdp_dtensor", args.ckpt_format == "fsdp_dtensor"),
                         ("--num-distributed-optimizer-instances > 1", instances > 1)):
            if on:
                _fail(f"{flag} requires --use-megatron-fsdp")
        if args.use_distributed_optimizer:
            _fail("--use-distributed-optimizer without --use-megatron-fsdp (Megatron's own distributed "
                  "optimizer) is not provided by this front-end; add --use-megatron-fsdp "
                  "--data-parallel-sharding-strategy optim for the same ZeRO-1 behaviour")
        return
    if args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "no_shard":
        _fail("--use-distributed-optimizer with --use-megatron-fsdp and --data-parallel-sharding-strategy no_shard: "
              "under Megatron-FSDP the strategy decides where optimizer state lives, and no_shard replicates it; "
              "pass --data-parallel-sharding-strategy optim (ZeRO-1), optim_grads or optim_grads_params")
    if args.outer_dp_sharding_strategy != "no_shard" and instances == 1:
        _fail("--outer-dp-sharding-strategy optim requires --num-distributed-optimizer-instances > 1 (HSDP)")
    if args.outer_dp_sharding_strategy == "optim" and args.data_parallel_sharding_strategy != "optim_grads_params":
        _fail("--outer-dp-sharding-strategy optim requires --data-parallel-sharding-strategy optim_grads_params")
    if args.ckpt_format not in ("fsdp_dtensor",) and (args.save or args.load):
        _fail(f"Megatron-FSDP only supports the fsdp_dtensor checkpoint format; got --ckpt-format "
              f"{args.ckpt_format}. Pass --ckpt-format fsdp_dtensor")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        _fail("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are mutually exclusive")
    if args.grad_reduce_in_bf16 and not args.bf16:  # Megatron accepts it; fp32 gradients are reduced in fp32
        print_rank_0("NOTE: --grad-reduce-in-bf16 has no effect without --bf16: the gradients are fp32")
        args.grad_reduce_in_bf16 = False
    if args.fsdp_double_buffer:
        _fail("--fsdp-double-buffer is not supported by megatron_fsdp: persistent double buffers serve NCCL user "
              "buffers; memory is bounded by the prefetch depth instead (see docs/options.md)")


def _validate_data_and_checkpoints(args: argparse.Namespace) -> None:
    if not args.mock_data and not args.data_path:
        _fail("give --data-path PREFIX (Megatron .bin/.idx dataset) or --mock-data")
    if args.mock_data and args.data_path:
        _fail("--mock-data and --data-path are mutually exclusive")
    if args.save_interval is not None and not args.save:
        # Megatron-LM accepts it (its DeepSeek proxy test comments --save out and keeps --save-interval)
        print_rank_0(f"NOTE: --save-interval {args.save_interval} has no effect without --save DIR: no checkpoints "
                     "will be written")

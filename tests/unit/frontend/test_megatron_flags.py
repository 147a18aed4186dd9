"""Megatron-LM's FSDP functional-test flags: parsed with Megatron's names, each with a status, effects at start-up.

The 8 command lines are Megatron-LM's own (tests/functional/megatron_lm_configs.py); the
expected dest names and defaults below are Megatron-LM 0.16.1's (``megatron/training/arguments.py``
and the dataclasses it builds flags from), the ``--megatron-fsdp-*-dtype`` ones its main branch's.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from megatron.training.arguments import ArgumentError, build_parser, parse_args, validate_args
from megatron.training.logging_utils import training_log_line, validation_log_lines
from megatron.training.megatron_flags import FLAG_STATUS, moe_freq_type
from tests.functional.megatron_lm_configs import MEGATRON_LM, cpu_scaled, megatron_argv
from tests.unit.frontend.test_frontend_model import scheduler_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BASE = ["--mock-data", "--vocab-size", "60"]
# megatron-core 0.16.1's MoE runs GeLU experts without biases, the bias-GeLU unfused (else start-up stops naming
# the flags)
GELU_EXPERTS = ["--num-experts", "2", "--disable-bias-linear", "--no-bias-gelu-fusion"]


@pytest.mark.parametrize("name", sorted(MEGATRON_LM))
def test_megatron_lm_command_lines_parse_unedited(name):
    parse_args(megatron_argv(name))  # argparse exits on an unrecognised flag


def test_the_eight_configurations_use_125_flags():
    flags = {a for name in MEGATRON_LM for a in megatron_argv(name) if a.startswith("--")}
    assert len(MEGATRON_LM) == 8 and len(flags) == 125, (len(MEGATRON_LM), len(flags))


# (flag, dest, default) as Megatron-LM defines them.
MEGATRON_DESTS = [
    ("--norm-epsilon", "layernorm_epsilon", 1e-5), ("--disable-bias-linear", "add_bias_linear", True),
    ("--fp8-format", "fp8", None), ("--fp8-recipe", "fp8_recipe", "delayed"),
    ("--use-mcore-models", "deprecated_use_mcore_models", False),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", True),
    ("--no-rope-fusion", "apply_rope_fusion", True), ("--no-bias-gelu-fusion", "bias_gelu_fusion", True),
    ("--use-checkpoint-opt_param-scheduler", "use_checkpoint_opt_param_scheduler", False),
    ("--transformer-impl", "transformer_impl", "transformer_engine"), ("--kv-lora-rank", "kv_lora_rank", 32),
    ("--qk-head-dim", "qk_head_dim", 128), ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", 64),
    ("--v-head-dim", "v_head_dim", 128), ("--mscale-all-dim", "mscale_all_dim", 0.0),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", "allgather"),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type", "aux_loss"),
    ("--moe-router-score-function", "moe_router_score_function", "softmax"),
    ("--moe-router-bias-update-rate", "moe_router_bias_update_rate", 1e-3), ("--moe-layer-freq", "moe_layer_freq", 1),
    ("--dist-ckpt-strictness", "dist_ckpt_strictness", "assume_ok_unexpected"),
    ("--megatron-fsdp-main-params-dtype", "megatron_fsdp_main_params_dtype", "fp32"),
    ("--megatron-fsdp-main-grads-dtype", "megatron_fsdp_main_grads_dtype", "auto"),
    ("--main-grads-dtype", "main_grads_dtype", "fp32"), ("--use-cpu-initialization", "use_cpu_initialization", None),
    ("--manual-gc-interval", "manual_gc_interval", 0), ("--timing-log-level", "timing_log_level", 0),
    ("--eval-interval", "eval_interval", None), ("--lr-wsd-decay-style", "lr_wsd_decay_style", "exponential"),
]


@pytest.mark.parametrize("flag,dest,default", MEGATRON_DESTS)
def test_dest_names_and_defaults_are_megatrons(flag, dest, default):
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    assert actions[flag].dest == dest and actions[flag].default == default, (actions[flag].dest,
                                                                             actions[flag].default)


def test_choice_lists_are_megatrons():
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    assert tuple(actions["--lr-decay-style"].choices) == ("constant", "linear", "cosine", "inverse-square-root",
                                                          "WSD")
    assert tuple(actions["--position-embedding-type"].choices) == ("learned_absolute", "rope", "mrope", "relative",
                                                                   "none")
    assert tuple(actions["--ckpt-format"].choices) == ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
    assert tuple(actions["--moe-token-dispatcher-type"].choices) == ("allgather", "alltoall", "flex")


def test_every_added_flag_has_a_status_and_is_documented():
    with open(os.path.join(ROOT, "docs", "megatron.md")) as f:
        docs = f.read()
    added = {a for name in MEGATRON_LM for a in megatron_argv(name) if a.startswith("--")}
    parser_flags = {o for a in build_parser()._actions for o in a.option_strings}
    for flag in FLAG_STATUS:
        assert flag in parser_flags, flag
        assert FLAG_STATUS[flag][0] in ("effect", "no-op", "stops"), flag
        assert f"`{flag}" in docs, f"{flag} is not listed in docs/megatron.md"
    for flag in added:  # the 125: each has a status here or a row of its own in the docs
        assert flag in FLAG_STATUS or re.search(re.escape(flag) + r"(?![\w-])", docs), flag


def _validated(argv: list[str], world: int = 2):
    return validate_args(parse_args(BASE + argv), world)


@pytest.mark.parametrize("argv,message", [
    (["--tokenizer-type", "ByteTokenizer", "--vocab-file", "v.json"],
     "--vocab-file is read only by --tokenizer-type GPT2BPETokenizer, not by --tokenizer-type ByteTokenizer"),
    (["--fp8-format", "e4m3"], "--fp8-format is not supported by this front-end: FP8 needs TransformerEngine"),
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)"),
    (["--fp8-format", "e4m3", "--fp8-param-gather"],
     "--fp8-param-gather is ZeRO-3 only here, as in Megatron-FSDP: pass --use-megatron-fsdp "
     "--data-parallel-sharding-strategy optim_grads_params (got --data-parallel-sharding-strategy no_shard without "
     "--use-megatron-fsdp)"),
    (["--fp8-format", "hybrid", "--fp8-param-gather", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
      "optim_grads"], "(got --data-parallel-sharding-strategy optim_grads)"),
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe is not supported by this front-end: with --fp8-format only"),
    (["--use-torch-fsdp2", "--use-megatron-fsdp"], "--use-torch-fsdp2 cannot be combined with --use-megatron-fsdp"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     "--use-torch-fsdp2 cannot be combined with --use-distributed-optimizer"),
    (["--use-torch-fsdp2", "--ckpt-format", "fsdp_dtensor"],
     "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp"),
    (["--use-torch-fsdp2", "--expert-model-parallel-size", "2", *GELU_EXPERTS],
     "--use-torch-fsdp2 cannot be combined with --expert-model-parallel-size > 1"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer is not supported"),
    (["--main-grads-dtype", "bf16"], "--main-grads-dtype is not supported"),
    (["--delay-wgrad-compute"], "--delay-wgrad-compute is not supported"),
    (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm is not supported"),
    (["--keep-fp8-transpose-cache"], "--keep-fp8-transpose-cache keeps the transposes of FP8 parameters: it needs "
                                      "--fp8-param-gather"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs TransformerEngine"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp is Megatron-LM's format for --use-torch-fsdp2"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "can only specify one of --lr-warmup-fraction and --lr-warmup-iters"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ([*GELU_EXPERTS, "--moe-token-dispatcher-type", "flex"], "flex needs DeepEP"),
    ([*GELU_EXPERTS, "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 other than --tensor-model-parallel-size (1) needs --expert-model-parallel-size"),
    ([*GELU_EXPERTS, "--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be positive"),
    (["--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "bf16"], "bf16 needs --bf16"),
    (["--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "fp16"], "fp16 is not supported"),
    (["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16"],
     "differs from the main-gradient dtype (fp32)"),
    (["--megatron-fsdp-main-grads-dtype", "fp32"], "require --use-megatron-fsdp"),
    ([*GELU_EXPERTS, "--moe-layer-freq", "[1,0,1]"], "--moe-layer-freq lists 3 layers"),
    # Megatron-LM main's distributed group
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--use-distributed-optimizer",
      "--megatron-fsdp-version", "2"], "--megatron-fsdp-version 2 is not compatible with --use-distributed-optimizer"),
    (["--pipeline-model-parallel-layout", "E|t|L"],
     "--pipeline-model-parallel-layout is not supported by this front-end: pipeline parallelism is not built"),
    (["--model-parallel-size", "2"], "--model-parallel-size is not supported by this front-end: Megatron-LM's old "
                                     "name, which it says not to use: pass --tensor-model-parallel-size"),
    (["--ddp-param-name-patterns-for-fp32-local-accumulation", "all"],
     "--ddp-param-name-patterns-for-fp32-local-accumulation is not supported"),
    (["--fake-process-group"], "--fake-process-group is not supported"),
    (["--gtp-remat-nccl-ub"], "--gtp-remat-nccl-ub is not supported"),
    (["--cp-comm-type", "ring"], "--cp-comm-type ring: Megatron-LM's types are p2p, a2a, allgather, a2a+p2p"),
    (["--torch-fsdp2-no-reshard-after-forward"], "--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2"),
])
def test_flags_that_cannot_act_stop_naming_the_flag(argv, message):
    if "transformer_engine" in argv and _te_installed():
        pytest.skip("TransformerEngine is installed")
    with pytest.raises(ArgumentError) as info:
        _validated(argv)
    assert message in str(info.value), str(info.value)


FP8_PARAM_GATHER_ZERO3 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather", "--use-megatron-fsdp",
                          "--data-parallel-sharding-strategy", "optim_grads_params", "--keep-fp8-transpose-cache"]


def test_fp8_param_gather_valid_combination_stops_naming_what_it_needs():
    """A valid --fp8-param-gather combination (ZeRO-3, a recipe) still stops at start-up: without TransformerEngine
    on CUDA naming what this machine lacks, with them saying the TransformerEngine FP8 gather is not built."""
    import torch

    with pytest.raises(ArgumentError) as info:
        _validated(FP8_PARAM_GATHER_ZERO3)
    message = str(info.value)
    missing = [what for what, absent in (("TransformerEngine", not _te_installed()),
                                         ("CUDA", not torch.cuda.is_available())) if absent]
    if missing:
        assert message.startswith("--fp8-param-gather is not supported by this front-end: FP8 parameters need "
                                  "TransformerEngine on CUDA"), message
        lacks = message.partition("; this machine lacks ")[2]
        assert lacks and all(what in lacks for what in missing), message
    else:
        assert "--fp8-param-gather is not supported by this front-end yet" in message, message
        assert "quantized_model_init" in message, message


def _te_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def test_deepseek_proxy_validates_with_every_megatron_core_flag():
    """The DeepSeek proxy's multi-latent attention, shared experts and router options are megatron-core's model's:
    validated as they are (nothing dropped, nothing refused)."""
    argv = cpu_scaled("deepseek_proxy_fsdp_ep2_fsdp2", "/tmp/unused")
    for flag in ("--multi-latent-attention", "--moe-shared-expert-intermediate-size", "--moe-router-pre-softmax",
                 "--moe-router-group-topk", "--moe-router-num-groups", "--moe-router-topk-scaling-factor",
                 "--moe-router-score-function", "--moe-router-enable-expert-bias",
                 "--moe-router-load-balancing-type"):
        assert flag in argv, (flag, argv)
    args = validate_args(parse_args(argv), 4)
    assert args.multi_latent_attention and args.moe_router_score_function == "sigmoid", vars(args)


def test_start_up_effects():
    args = _validated(["--lr-warmup-fraction", "0.25", "--train-iters", "8"])
    assert args.lr_warmup_iters == 2.0 and args.lr_decay_iters == 8  # Megatron: fraction x decay iterations
    assert args.transformer_impl == ("transformer_engine" if _te_installed() else "local") or \
        args.transformer_impl == "local"
    args = _validated(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                       "--num-distributed-optimizer-instances", "2", "--enable-full-sharding-in-hsdp"], 4)
    assert args.outer_dp_sharding_strategy == "optim"
    args = _validated(["--num-query-groups", "2"])
    assert args.num_query_groups is None  # Megatron reads it only with --group-query-attention
    assert _validated(["--group-query-attention", "--num-query-groups", "2"]).num_query_groups == 2
    args = _validated(["--use-megatron-fsdp", "--grad-reduce-in-bf16"])  # Megatron accepts it without --bf16
    assert args.grad_reduce_in_bf16 is False
    args = _validated(["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-params-dtype", "auto",
                       "--megatron-fsdp-main-grads-dtype", "bf16"])
    assert args.preserve_fp32_weights is False and args.grad_reduce_in_bf16 is True
    args = _validated(["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-grads-dtype", "fp32"])
    assert args.preserve_fp32_weights is True and args.accumulate_allreduce_grads_in_fp32 is True
    assert _validated(["--hidden-size", "64", "--num-attention-heads", "4"]).kv_channels == 16
    args = _validated(["--use-megatron-fsdp", "--megatron-fsdp-version", "2", "--cp-comm-type", "a2a", "p2p",
                       "--megatron-fsdp-max-pool-double-buffer", "--disable-symmetric-registration",
                       "--no-gradient-reduce-div-fusion", "--no-overlap-p2p-communication"])
    assert args.megatron_fsdp_version == 2 and args.cp_comm_type == ["a2a", "p2p"]
    args = _validated(["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"])
    assert args.torch_fsdp2_reshard_after_forward is False


def test_moe_layer_freq_reads_megatrons_expressions():
    assert moe_freq_type("([0]*3+[1]*5)") == [0, 0, 0, 1, 1, 1, 1, 1]
    assert moe_freq_type("2") == 2 and moe_freq_type("[1,0]*2") == [1, 0, 1, 0]
    with pytest.raises(Exception, match="only list literals"):
        moe_freq_type("__import__('os')")


def _lrs(style: str, steps: int, **kw) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_for(opt, max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style=style, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def test_inverse_square_root_and_wsd_schedules_follow_megatron():
    lrs = _lrs("inverse-square-root", 12)
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert lrs[8] == pytest.approx(max(0.1, 1.0 * math.sqrt(2) / math.sqrt(8)))
    assert lrs[11] == 0.1  # past the decay steps: min lr
    lrs = _lrs("WSD", 11, wsd_decay_steps=4, wsd_decay_style="linear")
    assert lrs[2:7] == [1.0] * 5  # stable until decay steps - WSD steps
    assert lrs[8] == pytest.approx(0.1 + (1 - 2 / 4) * 0.9) and lrs[10] == pytest.approx(0.1)
    lrs = _lrs("WSD", 11, wsd_decay_steps=4)  # exponential: 2 * 0.5**ratio - 1
    assert lrs[7] == pytest.approx(0.1 + (2 * 0.5 ** 0.25 - 1) * 0.9)


def test_log_line_has_megatrons_fields():
    line = training_log_line(iteration=4, train_iters=8, consumed=32, elapsed_ms=10.0, tflops=0.5, lr=1e-3,
                             global_batch=8, losses={"lm loss": 2.0, "load_balancing_loss": 1.01},
                             grad_norm=0.5, skipped=0, nan=0, num_zeros=7, params_norm=12.3456)
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration        4/       8 \|", line), line
    assert "| load_balancing_loss: 1.010000E+00 | loss scale: 1.0 | grad norm: 0.500 | num zeros: 7 | " \
           "params norm: 12.346 | number of skipped" in line, line
    assert " validation loss at iteration 8 on test set | lm loss value: 2.000000E+00 |" in \
        validation_log_lines("iteration 8 on test set", 2.0)

"""The rest of Megatron-LM's flags that its FSDP functional-test command lines use, and what each one does here.

Megatron-LM's 8 FSDP functional-test configurations (``gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor*``,
``gpt3_mcore_*_fsdp2_resume_torch_dist*``, ``..._8experts2parallel_top2router``, ``deepseek_proxy_fsdp_ep2_fsdp2*``)
pass flags beyond the core ones of ``arguments.py``. They are parsed here with Megatron-LM 0.16.1's
dest names, defaults and choices (the ``--megatron-fsdp-*-dtype`` flags: Megatron-LM's main branch,
after 0.16.1), and each one, by ``FLAG_STATUS``, either

- takes effect (``"effect"``): it changes what the run does (the text says how);
- is a documented no-op (``"no-op"``): accepted, with the reason it changes nothing here;
- stops the run at start-up (``"stops"``) when set, with a message naming the flag and what it needs.

The model is megatron-core's ``GPTModel`` (``mcore_model.py``): its architecture flags (multi-latent
attention, the MoE router's options, shared experts) take effect there.

No flag is accepted silently: ``tests/unit/frontend/test_megatron_flags.py`` checks that every flag
defined here has a status and is listed in docs/megatron.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from collections.abc import Callable

# --lr-decay-style, --position-embedding-type, --ckpt-format, --moe-token-dispatcher-type: Megatron-LM's choices.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "mrope", "relative", "none")
CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")  # megatron.core AttnBackend member names
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all")
FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")


def moe_freq_type(value: str) -> int | list[int]:
    """Megatron's ``--moe-layer-freq``: an int N (an MoE layer every N layers) or a list expression.

    ``"([0]*3+[1]*5)"`` is 3 dense then 5 MoE layers. Only list literals, ``+`` and ``*`` are
    evaluated (Megatron calls ``eval``; this parses the same expressions without it).
    """
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        pattern = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as error:
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {value!r}: give an int or a list expression such as ([0]*3+[1]*5) ({error})"
        ) from None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {value!r}: the list must hold 0 (dense) and 1 (MoE)")
    return pattern


def _eval_pattern(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(e) for e in node.elts]  # type: ignore[misc]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right  # type: ignore[operator]
    raise ValueError("only list literals of ints, + and * are allowed")


def moe_layer_pattern(args: argparse.Namespace) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (Megatron's reading of ``--moe-layer-freq``)."""
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def add_megatron_compat_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags beyond the core set, with its dest names, defaults and choices."""
    g = p.add_argument_group("logging (Megatron-LM)")
    g.add_argument("--log-params-norm", action="store_true", help="log the parameters' global L2 norm")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradient entries")
    g.add_argument("--log-throughput", action="store_true", help="also write throughput to tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--logging-level", type=int, default=None, help="Python logging level (10: DEBUG)")

    g = p.add_argument_group("data and tokenizer (Megatron-LM)")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("schedule, run length, memory (Megatron-LM)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup iterations = fraction x --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--manual-gc", action="store_true")
    g.add_argument("--manual-gc-interval", type=int, default=0)

    g = p.add_argument_group("implementation switches (Megatron-LM)")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None, dest="fp8")
    g.add_argument("--fp8-recipe", choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
                   default="delayed")
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")
    g.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32")
    g.add_argument("--main-params-dtype", choices=("fp32", "fp16"), default="fp32")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true")
    g.add_argument("--delay-wgrad-compute", action="store_true")

    g = p.add_argument_group("model architecture (Megatron-LM)")
    g.add_argument("--kv-channels", type=int, default=None, help="attention head size; default hidden / heads")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--multi-latent-attention", action="store_true")
    g.add_argument("--q-lora-rank", type=int, default=None)
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0)
    g.add_argument("--mscale", type=float, default=1.0)
    g.add_argument("--mscale-all-dim", type=float, default=0.0)

    g = p.add_argument_group("data parallelism (Megatron-LM)")
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--megatron-fsdp-main-params-dtype", choices=FSDP_DTYPES, default="fp32")
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=FSDP_DTYPES, default="auto")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", choices=FSDP_DTYPES, default="auto")
    g.add_argument("--suggested-communication-unit-size", type=int, default=None)
    g.add_argument("--keep-fp8-transpose-cache", action="store_true")
    g.add_argument("--enable-full-sharding-in-hsdp", action="store_true")
    g.add_argument("--create-all-gather-group", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--ddp-num-buckets", type=int, default=None)

    add_distributed_group_args(p.add_argument_group("Megatron-LM main's distributed group"))

    g = p.add_argument_group("checkpoints (Megatron-LM)")
    # --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler: arguments.py (the resume rule)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true")
    g.add_argument("--dist-ckpt-strictness", choices=DIST_CKPT_STRICTNESS, default="assume_ok_unexpected")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")


def add_distributed_group_args(g: argparse._ArgumentGroup) -> None:
    """The flags of Megatron-LM main's distributed argument group (``_add_distributed_args``, and its
    Megatron-FSDP flags beside ``--megatron-fsdp-main-params-dtype``) that the groups above do not define,
    with its dest names, defaults and choices."""
    g.add_argument("--megatron-fsdp-version", type=int, default=1, choices=[1, 2])
    g.add_argument("--megatron-fsdp-enable-fine-grained-param-gather", action="store_true")
    g.add_argument("--megatron-fsdp-max-pool-double-buffer", action="store_true")
    g.add_argument("--fsdp-db-use-persist-buf-on-alloc-fail", action="store_true")
    g.add_argument("--fsdp-manual-registration", action="store_true")
    g.add_argument("--disable-symmetric-registration", action="store_true")
    g.add_argument("--gtp-remat-nccl-ub", action="store_true")
    g.add_argument("--gtp-expert-remat-nccl-ub", action="store_true")
    g.add_argument("--no-gradient-reduce-div-fusion", action="store_false", dest="gradient_reduce_div_fusion")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward")
    g.add_argument("--no-use-layer-wise-param-layout", action="store_false", dest="use_layer_wise_param_layout")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true")
    g.add_argument("--gtp-remat-reduce-scatter-with-fp32-accumulation", action="store_true")
    g.add_argument("--ddp-param-name-patterns-for-fp32-local-accumulation", nargs="+", default=[])
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--model-parallel-size", type=int, default=None)
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    g.add_argument("--fake-process-group", action="store_true")


# The flags of add_distributed_group_args that stop a run when set, and the reason.
_PIPELINE = "pipeline parallelism is not built here (--pipeline-model-parallel-size 1 only)"
_NCCL_UB = ("it changes how --use-nccl-ub registers NCCL user buffers, and --use-nccl-ub stops here (pooled "
            "buffers, no registration); alone it changes nothing")
_DOUBLE_BUFFER = ("it changes --fsdp-double-buffer's allocator, and --fsdp-double-buffer stops here (the engine's "
                  "buffer pool recycles gathered-weight memory of any size); alone it changes nothing")
_CP_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def add_moe_compat_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's MoE router and layer flags (into the MoE group of moe_arguments.py)."""
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", choices=LOAD_BALANCING_TYPES, default="aux_loss")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)


_NO_FUSION = ("a fused CUDA kernel switch, passed to megatron-core's model; on CPU the fusion is off whatever the "
              "value (the unfused code computes the same numbers)")
_MCORE = "megatron-core's GPTModel implements it"

# flag -> (status, what it does here). Statuses: effect, no-op, stops (see the module docstring).
FLAG_STATUS: dict[str, tuple[str, str]] = {
    "--log-params-norm": ("effect", "the log line's `params norm` (global L2 norm of the parameters, each counted "
                          "once over shards and TP) and tensorboard `params-norm`"),
    "--log-num-zeros-in-grad": ("effect", "the log line's `num zeros` (zero entries of the reduced gradients, "
                                "each parameter counted once) and tensorboard `num-zeros`"),
    "--log-throughput": ("effect", "tensorboard `throughput` (the log line always shows throughput here)"),
    "--log-validation-ppl-to-tensorboard": ("effect", "tensorboard `lm loss validation ppl`"),
    "--log-timers-to-tensorboard": ("effect", "tensorboard `iteration-time` (seconds per iteration of the window)"),
    "--log-memory-to-tensorboard": ("effect", "tensorboard `mem-allocated-bytes`, `mem-max-allocated-bytes`, "
                                    "`mem-reserved-bytes` (CUDA allocator; resident set size on CPU)"),
    "--timing-log-level": ("no-op", "this front-end has one timer (the iteration time); levels 1 and 2 add "
                           "Megatron's per-phase timers, which do not exist here"),
    "--logging-level": ("effect", "the level of Python's root logger"),
    "--vocab-file": ("effect", "GPT-2's vocab.json for --tokenizer-type GPT2BPETokenizer (selected when the two "
                     "files are given without a --tokenizer-type, as Megatron-LM's configurations do)"),
    "--merge-file": ("effect", "GPT-2's merges.txt, as --vocab-file"),
    "--data-cache-path": ("effect", "where megatron-core caches the datasets' document, sample and shuffle indices "
                          "(default: PREFIX/cache/GPTDataset_indices beside the data, as Megatron-LM)"),
    "--lr-warmup-fraction": ("effect", "warmup iterations = fraction x --lr-decay-iters (Megatron's rule; not with "
                             "--lr-warmup-iters)"),
    "--lr-wsd-decay-style": ("effect", "the annealing shape of --lr-decay-style WSD"),
    "--lr-wsd-decay-iters": ("effect", "the annealing length of --lr-decay-style WSD (required with it)"),
    "--exit-duration-in-mins": ("effect", "stops training (saving a checkpoint if --save) once the run has trained "
                                "this many minutes; all ranks agree (max over ranks)"),
    "--manual-gc": ("effect", "Python's automatic garbage collector off during training, gc.collect() at start "
                    "and every --manual-gc-interval iterations"),
    "--manual-gc-interval": ("effect", "iterations between gc.collect() with --manual-gc (0: only at start)"),
    "--transformer-impl": ("effect", "local: this front-end's (or megatron-core's local) layers; "
                           "transformer_engine (Megatron's default) needs TransformerEngine and megatron-core's "
                           "model: without TransformerEngine the default falls back to local with a notice, "
                           "and an explicit --transformer-impl transformer_engine stops at start-up"),
    "--use-mcore-models": ("no-op", "deprecated in Megatron-LM (megatron-core models are its default); the model "
                           "is megatron-core's GPTModel here, always"),
    "--no-gradient-accumulation-fusion": ("no-op", _NO_FUSION),
    "--no-rope-fusion": ("no-op", _NO_FUSION),
    "--no-bias-gelu-fusion": ("no-op", _NO_FUSION + "; megatron-core's MoE with GeLU experts needs it (its fused "
                             "bias-GeLU has no per-token scale: without it start-up stops, naming the flag)"),
    "--attention-softmax-in-fp32": ("no-op", "megatron-core's model takes it (TransformerConfig."
                                    "attention_softmax_in_fp32: its softmax runs in fp32); the same numbers in fp32"),
    "--attention-backend": ("no-op", "megatron-core's model receives the value; its local layer spec's "
                            "attention is the unfused one whatever the value"),
    "--apply-query-key-layer-scaling": ("no-op", "it divides the scores by the layer number and multiplies them back "
                                        "in the softmax, an fp16 overflow guard; the same numbers in fp32 and bf16 "
                                        "(fp16 is refused); megatron-core's model takes it "
                                        "(TransformerConfig.apply_query_key_layer_scaling, softmax in fp32)"),
    "--use-cpu-initialization": ("no-op", "weights are drawn in full on every rank and sliced, so they are the same "
                                 "at any TP size: what the flag guarantees in Megatron"),
    "--fp8-format": ("stops", "FP8 needs TransformerEngine on CUDA"),
    "--fp8-recipe": ("stops", "with --fp8-format only (its default, delayed, is accepted)"),
    "--fp8-param-gather": ("stops", "FP8 parameters need TransformerEngine on CUDA, and the gather of "
                           "TransformerEngine's FP8 parameters is not built; checked first: needs --fp8-format, and "
                           "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (ZeRO-3 only, "
                           "as Megatron-FSDP)"),
    "--use-precision-aware-optimizer": ("stops", "TransformerEngine's FusedAdam; not available here"),
    "--main-grads-dtype": ("stops", "values other than fp32 need --use-precision-aware-optimizer"),
    "--main-params-dtype": ("stops", "values other than fp32 need --use-precision-aware-optimizer"),
    "--overlap-moe-expert-parallel-comm": ("stops", "megatron-core's 1F1B A2A overlap needs CUDA streams and "
                                           "pipeline scheduling"),
    "--delay-wgrad-compute": ("stops", "needs TransformerEngine's split weight-gradient GEMMs"),
    "--kv-channels": ("effect", "the attention head size (projections hold heads x kv-channels)"),
    "--norm-epsilon": ("effect", "epsilon of every LayerNorm/RMSNorm"),
    "--disable-bias-linear": ("effect", "no biases in the attention and MLP linear layers"),
    "--qk-layernorm": ("effect", "a norm (--normalization) over each query and key head before attention"),
    "--multi-latent-attention": ("effect", _MCORE),
    "--q-lora-rank": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--kv-lora-rank": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--qk-head-dim": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--qk-pos-emb-head-dim": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--v-head-dim": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--rotary-scaling-factor": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--mscale": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--mscale-all-dim": ("effect", "with --multi-latent-attention; " + _MCORE),
    "--use-torch-fsdp2": ("effect", "PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) as the data-parallel "
                          "backend, in place of DDP or --use-megatron-fsdp: transformer layers (and megatron-core's "
                          "untied embedding) are units, fp32 sharded parameters, bf16 compute with --bf16; "
                          "--ckpt-format torch_dist or torch_dcp; with TP, SP and CP; stops with --use-megatron-fsdp, "
                          "--use-distributed-optimizer and --expert-model-parallel-size > 1 (torch_fsdp2.py)"),
    "--megatron-fsdp-main-params-dtype": ("effect", "fp32: fp32 main weights (preserve_fp32_weights); auto: the "
                                          "model's dtype; bf16 needs --bf16; fp16 stops"),
    "--megatron-fsdp-main-grads-dtype": ("effect", "fp32: gradients accumulated and reduced in fp32; bf16 (with "
                                         "--bf16): in bf16; auto: Megatron's --grad-reduce-in-bf16 rule; fp16 stops"),
    "--megatron-fsdp-grad-comm-dtype": ("effect", "must equal the main-grads dtype (our reduction runs in it); auto "
                                        "follows it; another value stops"),
    "--suggested-communication-unit-size": ("no-op", "each FSDP unit is one collective here "
                                            "(DistributedDataParallelConfig.suggested_communication_unit_size)"),
    "--keep-fp8-transpose-cache": ("stops", "FP8 transpose caches need TransformerEngine FP8 parameters: "
                                   "--fp8-param-gather first"),
    "--enable-full-sharding-in-hsdp": ("effect", "an alias of --outer-dp-sharding-strategy optim (main weights and "
                                       "optimizer state sharded over all data-parallel ranks under HSDP)"),
    "--create-all-gather-group": ("no-op", "all-gathers and reduce-scatters run on one stream of one gloo/NCCL group "
                                  "here; a second group would not overlap them further"),
    "--ddp-bucket-size": ("no-op", "gradients are reduced one flat buffer per FSDP unit; DDP's bucket is PyTorch "
                          "DDP's (DistributedDataParallelConfig.bucket_size)"),
    "--ddp-num-buckets": ("no-op", "as --ddp-bucket-size"),
    "--use-checkpoint-opt_param-scheduler": ("effect", "on --load, the schedule's max/min lr, warmup, decay "
                                             "iterations and style (and WSD's) come from the checkpoint, not the "
                                             "flags (defined in arguments.py with --override-opt_param-scheduler)"),
    "--async-save": ("effect", "each save copies the state to host memory and a background thread of each rank "
                     "writes it (over a gloo group of its own) while training goes on; the tracker file names the "
                     "iteration once the write is complete; the next save and the end of training wait for it"),
    "--use-persistent-ckpt-worker": ("no-op", "--async-save writes from a thread of each rank, which needs no "
                                     "worker process to keep alive between saves"),
    "--dist-ckpt-strictness": ("no-op", "loads are strict here: a missing or unexpected key is an error naming it "
                               "(Megatron's flag tolerates TransformerEngine key renames, which cannot occur without "
                               "TransformerEngine)"),
    "--dist-ckpt-optim-fully-reshardable": ("no-op", "optimizer state is always saved fully reshardable (loads at "
                                            "any rank count, strategy, TP, CP, EP)"),
    "--moe-layer-freq": ("effect", "which layers are MoE (an int N: every N-th; a list such as ([0]*3+[1]*5)); the "
                         "others have a dense MLP"),
    "--moe-shared-expert-intermediate-size": ("effect", _MCORE),
    "--moe-router-load-balancing-type": ("effect", "megatron-core's MoE router's load-balancing loss "
                                         "(aux_loss, the default, seq_aux_loss, global_aux_loss, sinkhorn, none)"),
    "--moe-router-pre-softmax": ("effect", _MCORE),
    "--moe-router-group-topk": ("effect", _MCORE),
    "--moe-router-num-groups": ("effect", _MCORE),
    "--moe-router-topk-scaling-factor": ("effect", _MCORE),
    "--moe-router-score-function": ("effect", "softmax (the default) or sigmoid: " + _MCORE),
    "--moe-router-enable-expert-bias": ("effect", _MCORE),
    "--moe-router-bias-update-rate": ("effect", "with --moe-router-enable-expert-bias; " + _MCORE),
    "--moe-router-dtype": ("effect", "fp32 or fp64 router logits and probabilities: " + _MCORE),
    "--moe-grouped-gemm": ("no-op", "experts compute one matmul each; a grouped GEMM (TransformerEngine or "
                           "grouped_gemm on CUDA) gives the same numbers faster; on CPU megatron-core's model builds "
                           "its SequentialMLP in place of GroupedMLP (parameters local_experts.N.*, not weight1/2)"),
    "--moe-permute-fusion": ("no-op", _NO_FUSION),
    "--moe-token-dispatcher-type": ("effect", "allgather (Megatron's default) and alltoall: the same routing; "
                                    "megatron-core's model uses the dispatcher named; flex needs DeepEP and stops"),
    "--expert-tensor-parallel-size": ("effect", "megatron-core's expert tensor parallelism (default: the TP size): "
                                      "each expert's linear layers split over the expert-TP group, expert "
                                      "parameters sharded over world / (ETP x EP) expert data-parallel ranks; "
                                      "sizes > 1 need megatron-core's model; a size other than the TP size needs "
                                      "--expert-model-parallel-size > 1"),
    "--megatron-fsdp-version": ("effect", "1 (default) or 2, Megatron-LM's placements API (megatron_fsdp."
                                "experimental): both run this one engine with the same strategy flags, and the "
                                "start-up summary says so; 2 with --use-distributed-optimizer stops, as in "
                                "Megatron-LM; without --use-megatron-fsdp it changes nothing (as there)"),
    "--megatron-fsdp-enable-fine-grained-param-gather": ("no-op", "each FSDP unit's weights are one all-gather, "
                                                         "prefetched a unit ahead; the finer gather serves MXFP8 "
                                                         "recompute with TransformerEngine, not available here"),
    "--megatron-fsdp-max-pool-double-buffer": ("no-op", _DOUBLE_BUFFER),
    "--fsdp-db-use-persist-buf-on-alloc-fail": ("no-op", _DOUBLE_BUFFER),
    "--fsdp-manual-registration": ("no-op", _NCCL_UB),
    "--disable-symmetric-registration": ("no-op", _NCCL_UB),
    "--gtp-remat-nccl-ub": ("stops", "GTP weight rematerialisation (and its NCCL symmetric buffers) is not built"),
    "--gtp-expert-remat-nccl-ub": ("stops", "GTP weight rematerialisation of experts is not built"),
    "--no-gradient-reduce-div-fusion": ("no-op", "the engine scales each gradient inside its reduction either way "
                                        "(gradient_scaling); the same numbers"),
    "--torch-fsdp2-no-reshard-after-forward": ("effect", "with --use-torch-fsdp2: FSDP2's reshard_after_forward="
                                               "False (ZeRO-2-like: weights stay gathered from forward to backward); "
                                               "without --use-torch-fsdp2 it stops"),
    "--no-use-layer-wise-param-layout": ("no-op", "the LayerWise layout is Megatron-LM's Muon optimizer's; this "
                                         "front-end trains with Adam"),
    "--ddp-pad-buckets-for-high-nccl-busbw": ("no-op", "as --ddp-bucket-size: no DDP buckets in the engine; the "
                                              "DDP baseline is PyTorch DDP's"),
    "--ddp-reduce-scatter-with-fp32-accumulation": ("stops", "a low-precision all-to-all with fp32 local "
                                                    "accumulation is not built; --megatron-fsdp-main-grads-dtype "
                                                    "fp32 reduces in fp32"),
    "--gtp-remat-reduce-scatter-with-fp32-accumulation": ("stops", "GTP weight rematerialisation is not built"),
    "--ddp-param-name-patterns-for-fp32-local-accumulation": ("stops", "per-parameter fp32 accumulation patterns "
                                                              "are not built; --megatron-fsdp-main-grads-dtype fp32 "
                                                              "accumulates every gradient in fp32"),
    "--overlap-param-gather-with-optimizer-step": ("stops", "Megatron-LM allows it with interleaved pipeline "
                                                   "parallelism only; " + _PIPELINE),
    "--no-align-param-gather": ("no-op", "it staggers the all-gathers of pipeline stages; one stage here"),
    "--no-overlap-p2p-communication": ("no-op", "no pipeline point-to-point communication: one stage here"),
    "--decoder-first-pipeline-num-layers": ("stops", _PIPELINE),
    "--decoder-last-pipeline-num-layers": ("stops", _PIPELINE),
    "--pipeline-model-parallel-layout": ("stops", _PIPELINE),
    "--num-layers-per-virtual-pipeline-stage": ("stops", _PIPELINE),
    "--num-virtual-stages-per-pipeline-rank": ("stops", _PIPELINE),
    "--model-parallel-size": ("stops", "Megatron-LM's old name, which it says not to use: pass "
                              "--tensor-model-parallel-size"),
    "--cp-comm-type": ("no-op", "context parallelism gathers keys and values from every CP rank (the allgather "
                       "type) whatever the value; p2p, a2a and a2a+p2p compute the same attention by other "
                       "exchanges; an unknown type stops"),
    "--fake-process-group": ("stops", "a fake process group skips every collective, so a training run would be "
                             "wrong; not built"),
}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def validate_megatron_compat_args(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Check and derive what the flags of this module need (in place); stop naming the flag where one cannot act."""
    _resolve_transformer_impl(args, fail)
    _check_stops(args, fail)
    _resolve_fsdp_dtypes(args, fail)
    if args.enable_full_sharding_in_hsdp:
        args.outer_dp_sharding_strategy = "optim"
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    elif args.kv_channels <= 0:
        fail(f"--kv-channels must be positive, got {args.kv_channels}")
    if not (args.layernorm_epsilon > 0):
        fail(f"--norm-epsilon must be > 0, got {args.layernorm_epsilon}")
    if args.manual_gc_interval < 0:
        fail(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        fail(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    _check_moe_compat(args, fail)


def _resolve_transformer_impl(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Megatron's default is transformer_engine; left at the default it means local where that cannot run.

    An explicit ``--transformer-impl transformer_engine`` without TransformerEngine stops.
    """
    if args.transformer_impl != "transformer_engine":
        return
    if _given(args, "--transformer-impl"):
        if not transformer_engine_available():
            fail("--transformer-impl transformer_engine needs TransformerEngine (pip install transformer-engine, "
                 "CUDA only), which is not installed; pass --transformer-impl local")
        return
    if not transformer_engine_available():
        args.transformer_impl = "local"


def default_transformer_impl(args: argparse.Namespace) -> None:
    """Left at Megatron's default (transformer_engine), ``--transformer-impl`` means local without TransformerEngine.

    Resolved before megatron-core's model is checked (``check_mcore_model``), so that it builds with its local
    layers on a machine without TransformerEngine instead of stopping.
    """
    if (args.transformer_impl == "transformer_engine" and not _given(args, "--transformer-impl")
            and not transformer_engine_available()):
        args.transformer_impl = "local"


def _given(args: argparse.Namespace, flag: str) -> bool:
    return flag in getattr(args, "argv_flags", ())


def _check_stops(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    _check_fp8(args, fail)
    for flag, on in (
        ("--use-precision-aware-optimizer", args.use_precision_aware_optimizer),
        ("--main-grads-dtype", args.main_grads_dtype != "fp32"),
        ("--main-params-dtype", args.main_params_dtype != "fp32"),
        ("--overlap-moe-expert-parallel-comm", args.overlap_moe_expert_parallel_comm),
        ("--delay-wgrad-compute", args.delay_wgrad_compute),
    ):
        if on:
            fail(f"{flag} is not supported by this front-end: {FLAG_STATUS[flag][1]}")
    _check_distributed_group(args, fail)
    if args.ckpt_format == "torch_dcp" and not args.use_torch_fsdp2:
        fail("--ckpt-format torch_dcp is Megatron-LM's format for --use-torch-fsdp2; pass --use-torch-fsdp2, or "
             "--ckpt-format fsdp_dtensor with --use-megatron-fsdp (torch_dist with DDP)")
    if args.use_torch_fsdp2:
        _check_torch_fsdp2(args, fail)
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters != 0:
            fail("can only specify one of --lr-warmup-fraction and --lr-warmup-iters")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            fail(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        fail("--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing iterations)")


def _check_fp8(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """The FP8 flags: first the combinations Megatron-FSDP allows, then what this front-end cannot run.

    Megatron-FSDP (its README): FP8 parameters come from a TransformerEngine FP8 recipe (``--fp8-format``)
    and exist under ZeRO-3 only (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``);
    ``--keep-fp8-transpose-cache`` keeps the transposes of those parameters, so it needs them. A valid
    combination still stops: without TransformerEngine on CUDA it cannot run at all, and with them the path
    that gathers TransformerEngine's FP8 parameters is not built (docs/mixed_precision.md says why).
    """
    import torch  # here: the flag tables above are read without torch (docs, tests)

    fp8, param_gather, transpose = args.fp8 is not None, args.fp8_param_gather, args.keep_fp8_transpose_cache
    if args.fp8_recipe != "delayed" and not fp8:
        fail(f"--fp8-recipe is not supported by this front-end: {FLAG_STATUS['--fp8-recipe'][1]}")
    if not (fp8 or param_gather or transpose):
        return
    if transpose and not param_gather:
        fail("--keep-fp8-transpose-cache keeps the transposes of FP8 parameters: it needs --fp8-param-gather")
    if param_gather:
        if not fp8:
            fail("--fp8-param-gather needs --fp8-format (e4m3 or hybrid): the FP8 parameters are quantized by a "
                 "TransformerEngine FP8 recipe (--fp8-recipe)")
        strategy = args.data_parallel_sharding_strategy
        if not args.use_megatron_fsdp or strategy != "optim_grads_params":
            fail("--fp8-param-gather is ZeRO-3 only here, as in Megatron-FSDP: pass --use-megatron-fsdp "
                 f"--data-parallel-sharding-strategy optim_grads_params (got --data-parallel-sharding-strategy "
                 f"{strategy}{'' if args.use_megatron_fsdp else ' without --use-megatron-fsdp'})")
    flag = "--fp8-param-gather" if param_gather else "--fp8-format"
    missing = [what for what, absent in (("TransformerEngine (pip install transformer-engine)",
                                          not transformer_engine_available()),
                                         ("CUDA", not torch.cuda.is_available())) if absent]
    if missing:
        fail(f"{flag} is not supported by this front-end: {FLAG_STATUS[flag][1]}; this machine lacks "
             f"{' and '.join(missing)}")
    fail(f"{flag} is not supported by this front-end yet: building the model under TransformerEngine's "
         "quantized_model_init and gathering its FP8 parameters is not built (docs/mixed_precision.md, "
         "'TransformerEngine FP8 parameters'); use MixedPrecisionPolicy(gather_format='mxfp8') or gather_dtype "
         "through the library for a float8 weight all-gather")


def _check_distributed_group(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Stop naming the flag where a flag of ``add_distributed_group_args`` cannot act (``FLAG_STATUS``)."""
    for flag, on in (
        ("--gtp-remat-nccl-ub", args.gtp_remat_nccl_ub),
        ("--gtp-expert-remat-nccl-ub", args.gtp_expert_remat_nccl_ub),
        ("--ddp-reduce-scatter-with-fp32-accumulation", args.ddp_reduce_scatter_with_fp32_accumulation),
        ("--gtp-remat-reduce-scatter-with-fp32-accumulation", args.gtp_remat_reduce_scatter_with_fp32_accumulation),
        ("--ddp-param-name-patterns-for-fp32-local-accumulation",
         bool(args.ddp_param_name_patterns_for_fp32_local_accumulation)),
        ("--overlap-param-gather-with-optimizer-step", args.overlap_param_gather_with_optimizer_step),
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers is not None),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers is not None),
        ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout is not None),
        ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage is not None),
        ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank is not None),
        ("--model-parallel-size", args.model_parallel_size is not None),
        ("--fake-process-group", args.fake_process_group),
    ):
        if on:
            fail(f"{flag} is not supported by this front-end: {FLAG_STATUS[flag][1]}")
    unknown = [t for t in args.cp_comm_type if t not in _CP_TYPES]
    if unknown:
        fail(f"--cp-comm-type {' '.join(unknown)}: Megatron-LM's types are {', '.join(_CP_TYPES)}")
    if args.use_megatron_fsdp and args.megatron_fsdp_version == 2 and args.use_distributed_optimizer:
        fail("--megatron-fsdp-version 2 is not compatible with --use-distributed-optimizer")
    if not args.use_torch_fsdp2 and not args.torch_fsdp2_reshard_after_forward:
        fail("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2 (it sets FSDP2's reshard_after_forward)")


def _check_torch_fsdp2(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Megatron-LM's conditions on --use-torch-fsdp2 (arguments.py), and what this front-end does not build with it."""
    for what, on in (
        ("--use-megatron-fsdp (two data-parallel backends: pass one of them)", args.use_megatron_fsdp),
        ("--use-distributed-optimizer (Megatron-LM refuses it too: FSDP2 shards the optimizer state itself)",
         args.use_distributed_optimizer),
        ("--expert-model-parallel-size > 1 (Megatron-LM refuses it too)", args.expert_model_parallel_size > 1),
    ):
        if on:
            fail(f"--use-torch-fsdp2 cannot be combined with {what}")
    if args.ckpt_format not in ("torch_dist", "torch_dcp"):
        fail(f"--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp (as in Megatron-LM), got "
             f"--ckpt-format {args.ckpt_format}; both write the sharded DCP checkpoint of docs/megatron.md")


def _resolve_fsdp_dtypes(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Megatron-FSDP's dtype flags onto our options: fp32 main weights, and the gradient reduction dtype."""
    params, grads, comm = (args.megatron_fsdp_main_params_dtype, args.megatron_fsdp_main_grads_dtype,
                           args.megatron_fsdp_grad_comm_dtype)
    for flag, value in (("--megatron-fsdp-main-params-dtype", params), ("--megatron-fsdp-main-grads-dtype", grads),
                        ("--megatron-fsdp-grad-comm-dtype", comm)):
        if value == "fp16":
            fail(f"{flag} fp16 is not supported: this front-end has no fp16 (use bf16)")
        if value == "bf16" and not args.bf16:
            fail(f"{flag} bf16 needs --bf16 (the model's weights and gradients are fp32 otherwise)")
    # The main weights: fp32 (the default) keeps fp32 main weights beside bf16 ones; auto/bf16 uses the model's.
    args.preserve_fp32_weights = params == "fp32"
    if grads == "fp32":
        args.accumulate_allreduce_grads_in_fp32 = True
        if args.grad_reduce_in_bf16:
            fail("--megatron-fsdp-main-grads-dtype fp32 and --grad-reduce-in-bf16 contradict each other")
    elif grads == "bf16":
        args.grad_reduce_in_bf16 = True
    resolved = "fp32" if grads == "fp32" or (grads == "auto" and not (args.bf16 and args.grad_reduce_in_bf16)) \
        else "bf16"
    if comm not in ("auto", resolved):
        fail(f"--megatron-fsdp-grad-comm-dtype {comm} differs from the main-gradient dtype ({resolved}): gradients "
             "are reduced in the dtype they accumulate in here; pass auto or --megatron-fsdp-main-grads-dtype "
             f"{comm}")
    if not args.use_megatron_fsdp and (params != "fp32" or grads != "auto" or comm != "auto"):
        fail("--megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype "
             "require --use-megatron-fsdp")


def _check_moe_compat(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq <= 0:
        fail(f"--moe-layer-freq must be positive, got {freq}")
    if isinstance(freq, list) and len(freq) != args.num_layers:
        fail(f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {args.num_layers}")
    if args.moe_token_dispatcher_type == "flex":
        fail("--moe-token-dispatcher-type flex needs DeepEP (CUDA); use allgather or alltoall")
    if args.expert_tensor_parallel_size is None:  # Megatron's validate_args: the TP size
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size
    if etp < 1:
        fail(f"--expert-tensor-parallel-size must be positive, got {etp}")
    if args.num_experts is None:
        return
    if isinstance(freq, list) and not any(freq):
        fail("--moe-layer-freq marks no layer as MoE, but --num-experts is given")

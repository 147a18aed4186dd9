"""The functional-regression configurations: tiny GPTs trained for a few dozen iterations on CPU.

Each entry: world size, the ``pretrain_gpt.py`` flags beyond ``COMMON``, the
relative tolerance its checked-in golden values are compared with (``rtol``:
1e-5 fp32, 1e-2 bf16; goldens come from another machine, whose CPU may take
other SIMD paths), and the one it is compared with against its baseline run
of the same test run (``baseline_rtol``: 0 means bitwise). ``{ckpt}`` in flags
is replaced by a checkpoint directory of this world size, ``{ckpt2}`` by the
2-rank one (``resume_*`` continue what ``save_*`` wrote; the 2-rank group runs
first).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.functional.megatron_lm_configs import cpu_scaled

ITERS = 16

COMMON = (
    "--mock-data --vocab-size 60 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0 --log-interval 4 "
    "--make-vocab-size-divisible-by 16 --seed 42 --log-params-norm --log-num-zeros-in-grad"
).split()  # params norm and num zeros: compared between strategies like the losses

# GeLU experts without biases: megatron-core 0.16.1's experts cannot add a bias (in place on an autograd view), and
# fuse the bias-GeLU only without the router's per-token probabilities (mcore_model.mcore_blockers).
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01 "
       "--disable-bias-linear --no-bias-gelu-fusion").split()
FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy".split()


@dataclass(frozen=True)
class Config:
    name: str
    world_size: int
    flags: tuple[str, ...]
    rtol: float  # against the golden values (and against the baseline's golden values when it did not run)
    baseline: str | None = None  # the run it must agree with
    first_iteration: int = 1
    last_iteration: int = ITERS
    baseline_rtol: float | None = None  # against the baseline run of this test run; None: rtol
    own_flags: bool = False  # flags is the whole command line (Megatron-LM's configurations), without COMMON

    @property
    def same_run_rtol(self) -> float:
        return self.rtol if self.baseline_rtol is None else self.baseline_rtol

    def argv(self, ckpt_root: str) -> list[str]:
        flags = [f.replace("{ckpt}", f"{ckpt_root}/w{self.world_size}").replace("{ckpt2}", f"{ckpt_root}/w2")
                 for f in self.flags]
        if self.own_flags:
            return flags
        return [*COMMON, "--train-iters", str(ITERS), *flags]


def _cfg(name, world, flags, rtol=1e-5, baseline=None, first=1, last=ITERS, baseline_rtol=None) -> Config:
    return Config(name, world, tuple(flags.split()), rtol, baseline, first, last, baseline_rtol)


# Megatron's default dropout (COMMON turns it off), and evaluation: the RNG states a checkpoint restores
# must leave the resumed run drawing exactly the masks of the uninterrupted one.
DROPOUT = "--attention-dropout 0.1 --hidden-dropout 0.1 --eval-interval 4 --eval-iters 1"
# A resume at another world size cannot restore per-rank RNG states, so dropout masks differ from the
# uninterrupted run's and the losses agree only statistically. Measured (2 -> 4 ranks, iterations 9-16):
# at most 2.0e-3 relative; the same resume without the optimizer state (--no-load-optim) is off by up to
# 6.9e-3, one from scratch by 10%. The dropout masks are deterministic, so these numbers are too.
OTHER_WORLD_DROPOUT_RTOL = 4e-3
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")


CONFIGS: dict[str, Config] = {c.name: c for c in (
    _cfg("ddp", 2, ""),
    _cfg("optim", 2, " ".join([*FSDP, "optim"]), baseline="ddp"),
    _cfg("optim_grads", 2, " ".join([*FSDP, "optim_grads"]), baseline="ddp"),
    _cfg("optim_grads_params", 2, " ".join([*FSDP, "optim_grads_params"]), baseline="ddp"),
    _cfg("meta_init", 2, " ".join([*FSDP, "optim_grads_params", "--init-model-with-meta-device"]),
         baseline="ddp"),
    _cfg("bf16", 2, " ".join([*FSDP, "optim_grads_params", "--bf16"]), rtol=1e-2, baseline="ddp_bf16"),
    _cfg("ddp_bf16", 2, "--bf16", rtol=1e-2),
    # PyTorch FSDP2 (--use-torch-fsdp2), the third backend: against DDP as our engine is (optim_grads_params above),
    # and saved at 8 / resumed to 16 bitwise (--ckpt-format torch_dist, its default).
    _cfg("fsdp2", 2, "--use-torch-fsdp2", baseline="ddp"),
    _cfg("fsdp2_bf16", 2, "--use-torch-fsdp2 --bf16", rtol=1e-2, baseline="ddp_bf16"),
    _cfg("save_fsdp2", 2, "--use-torch-fsdp2 --save {ckpt}-fsdp2 --save-interval 4 --exit-interval 8",
         baseline="fsdp2", last=8, baseline_rtol=0.0),
    _cfg("resume_fsdp2", 2, "--use-torch-fsdp2 --load {ckpt}-fsdp2", baseline="fsdp2", first=9, baseline_rtol=0.0),
    # The FSDP2 checkpoint resumed by our engine (the same FQN-keyed DCP layout): the FSDP2 curve continues.
    _cfg("resume_zero3_from_fsdp2", 2, " ".join([*FSDP, "optim_grads_params", "--load {ckpt}-fsdp2"]),
         baseline="fsdp2", first=9),
    # Stop at 8 (the schedule still spans 16 iterations), resume: the uninterrupted run's losses, exactly.
    _cfg("save_zero3", 2, " ".join([*FSDP, "optim_grads_params", "--save {ckpt} --save-interval 4 --exit-interval 8"]),
         baseline="optim_grads_params", last=8, baseline_rtol=0.0),
    _cfg("resume_zero3", 2, " ".join([*FSDP, "optim_grads_params", "--load {ckpt}"]), baseline="optim_grads_params",
         first=9, baseline_rtol=0.0),
    # The same with dropout on and evaluation every 4 iterations: bitwise too.
    _cfg("dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT])),
    _cfg("save_dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT,
                                      "--save {ckpt}-dropout --save-interval 4 --exit-interval 8"]),
         baseline="dropout", last=8, baseline_rtol=0.0),
    _cfg("resume_dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT, "--load {ckpt}-dropout"]),
         baseline="dropout", first=9, baseline_rtol=0.0),
    # Dropout under TP2 x DP1 with sequence parallelism: every dropout draws from the model-parallel RNG
    # (seed + 2718 + TP rank), whose states the checkpoint must restore per rank for a bitwise resume.
    _cfg("tp2_sp_dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT, *TP2_SP])),
    _cfg("save_tp2_sp_dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT, *TP2_SP,
                                             "--save {ckpt}-tp2-sp-dropout --save-interval 4 --exit-interval 8"]),
         baseline="tp2_sp_dropout", last=8, baseline_rtol=0.0),
    _cfg("resume_tp2_sp_dropout", 2, " ".join([*FSDP, "optim_grads_params", DROPOUT, *TP2_SP,
                                               "--load {ckpt}-tp2-sp-dropout"]),
         baseline="tp2_sp_dropout", first=9, baseline_rtol=0.0),
    # A TP2 x DP1 checkpoint (saved at 8): resumed at TP1 x DP4 below. TP2 matches DP alone within fp32 rounding.
    _cfg("save_tp2_zero3", 2, " ".join([*FSDP, "optim_grads_params", "--tensor-model-parallel-size 2",
                                        "--save {ckpt}-tp2 --save-interval 4 --exit-interval 8"]),
         baseline="optim_grads_params", last=8),
    _cfg("ddp_4", 4, ""),
    _cfg("hsdp_4", 4, " ".join([*FSDP, "optim_grads_params", "--num-distributed-optimizer-instances 2"]),
         baseline="ddp_4"),
    _cfg("hsdp_optim_4", 4, " ".join([*FSDP, "optim_grads_params", "--num-distributed-optimizer-instances 2",
                                       "--outer-dp-sharding-strategy optim"]), baseline="ddp_4"),
    _cfg("optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params"]), baseline="ddp_4"),
    # The 2-rank ZeRO-3 checkpoint resumed at 4 ranks with ZeRO-1: the 2-rank run's curve continues.
    _cfg("resume_4_from_2_optim", 4, " ".join([*FSDP, "optim", "--load {ckpt2}"]), baseline="optim_grads_params",
         first=9),
    # Tensor parallelism (TP2 x DP2): the same data-parallel size and global batch as the 2-rank runs, so the
    # same curve within fp32 rounding (Megatron's layers sum partial products in another order).
    _cfg("tp2_ddp_4", 4, "--tensor-model-parallel-size 2", baseline="ddp"),
    _cfg("tp2_optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params", "--tensor-model-parallel-size 2"]),
         baseline="optim_grads_params"),
    _cfg("tp2_sp_optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params", "--tensor-model-parallel-size 2",
                                                      "--sequence-parallel"]), baseline="optim_grads_params"),
    _cfg("tp2_sp_optim_4", 4, " ".join([*FSDP, "optim", "--tensor-model-parallel-size 2", "--sequence-parallel",
                                         "--swiglu", "--position-embedding-type rope"])),
    # PyTorch FSDP2 with TP2 x SP (sharded over DP2) and with CP2 x DP2 (sharded over both): the same curves.
    _cfg("tp2_sp_fsdp2_4", 4, "--use-torch-fsdp2 --tensor-model-parallel-size 2 --sequence-parallel",
         baseline="tp2_sp_optim_grads_params_4"),
    _cfg("cp2_fsdp2_4", 4, "--use-torch-fsdp2 --context-parallel-size 2", baseline="cp2_ddp_4"),
    # Context parallelism (CP2 x DP2; TP2 x CP2 x DP1 with 4 micro-batches per step): the same global batches.
    _cfg("cp2_ddp_4", 4, "--context-parallel-size 2", baseline="ddp"),
    _cfg("cp2_optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params", "--context-parallel-size 2"]),
         baseline="optim_grads_params"),
    _cfg("tp2_cp2_sp_optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params", "--context-parallel-size 2",
                                                          "--tensor-model-parallel-size 2", "--sequence-parallel"]),
         baseline="optim_grads_params"),
    # Mixture of Experts (megatron-core's MoELayer: 4 experts, top-2, aux loss), at EP1 and EP2 x EDP2 (experts their
    # own units over EDP). EP2 is not compared with EP1: megatron-core draws each rank's local experts in turn from
    # the generator, so at EP2 the experts start from other weights (iteration 1 differs by 2.8e-4 relative).
    _cfg("moe_ep1_4", 4, " ".join([*FSDP, "optim_grads_params", *MOE])),
    _cfg("moe_ep2_4", 4, " ".join([*FSDP, "optim_grads_params", *MOE, "--expert-model-parallel-size 2"])),
    # The same with HSDP on the dense part (2 instances x 2 shards; experts over EDP2): EP2's curve.
    _cfg("moe_ep2_hsdp_4", 4, " ".join([*FSDP, "optim_grads_params", *MOE, "--expert-model-parallel-size 2",
                                        "--num-distributed-optimizer-instances 2"]), baseline="moe_ep2_4"),
    # The 2-rank ZeRO-3 checkpoint resumed with CP2 x DP2: the 2-rank run's curve continues.
    _cfg("resume_cp2_4_from_2", 4, " ".join([*FSDP, "optim_grads_params", "--context-parallel-size 2",
                                              "--load {ckpt2}"]), baseline="optim_grads_params", first=9),
    # The 2-rank TP2 checkpoint resumed at TP1 x DP4 (checkpoints hold the unsplit model): the curve continues.
    _cfg("resume_4_from_tp2_2", 4, " ".join([*FSDP, "optim_grads_params", "--load {ckpt2}-tp2"]),
         baseline="optim_grads_params", first=9),
    # The 2-rank dropout checkpoint at 4 ranks: RNG states are not restored (a warning says so).
    _cfg("resume_dropout_4_from_2", 4, " ".join([*FSDP, "optim_grads_params", DROPOUT, "--load {ckpt2}-dropout"]),
         baseline="dropout", first=9, baseline_rtol=OTHER_WORLD_DROPOUT_RTOL),
)}


def _mlm(name: str, world: int, megatron_name: str, *, rtol: float, suffix: str = "", extra: str = "",
         baseline: str | None = None, first: int = 1, last: int = ITERS, baseline_rtol: float | None = None) -> Config:
    """One of Megatron-LM's FSDP functional-test configurations scaled to CPU (megatron_lm_configs.py)."""
    flags = cpu_scaled(megatron_name, "{ckpt}-" + megatron_name + suffix) + extra.split()
    return Config(name, world, tuple(flags), rtol, baseline, first, last, baseline_rtol, own_flags=True)


_DTENSOR = "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor"  # and its _1node twin: the same MODEL_ARGS
_FSDP2_TP2 = "gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist"
_FSDP2_TP1 = "gpt3_mcore_tp1_pp1_fsdp2_resume_torch_dist_te"
_EXPERTS = "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router"
_DEEPSEEK = "deepseek_proxy_fsdp_ep2_fsdp2"  # and _1node: the same flags at another size
_DEEPSEEK_OVERLAP = "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap"
# Megatron-LM's resume tests: a run saved at 8 (--exit-interval 8), then resumed from its directory to 16;
# where an uninterrupted run is listed, the resumed one must reproduce it bit for bit.
CONFIGS.update({c.name: c for c in (
    # On megatron-core's GPTModel as every configuration: the dense ones with its TP layers, FSDP2 and
    # fsdp_dtensor / torch_dist checkpoints, the MoE ones with its MoELayer, router options and shared experts.
    _mlm("mlm_fsdp2_tp1_save", 2, _FSDP2_TP1, rtol=1e-2, extra="--exit-interval 8", last=8),
    _mlm("mlm_fsdp2_tp1_resume", 2, _FSDP2_TP1, rtol=1e-2, first=9),
    _mlm("mlm_fsdp_dtensor", 4, _DTENSOR, rtol=1e-2, suffix="-full"),
    _mlm("mlm_fsdp_dtensor_save", 4, _DTENSOR, rtol=1e-2, extra="--exit-interval 8", last=8,
         baseline="mlm_fsdp_dtensor", baseline_rtol=0.0),
    _mlm("mlm_fsdp_dtensor_resume", 4, _DTENSOR, rtol=1e-2, first=9, baseline="mlm_fsdp_dtensor",
         baseline_rtol=0.0),
    _mlm("mlm_fsdp2_tp2_save", 4, _FSDP2_TP2, rtol=1e-2, extra="--exit-interval 8", last=8),
    _mlm("mlm_fsdp2_tp2_resume", 4, _FSDP2_TP2, rtol=1e-2, first=9),
    _mlm("mlm_experts", 4, _EXPERTS, rtol=1e-2, suffix="-full"),
    _mlm("mlm_experts_save", 4, _EXPERTS, rtol=1e-2, extra="--exit-interval 8", last=8, baseline="mlm_experts",
         baseline_rtol=0.0),
    _mlm("mlm_experts_resume", 4, _EXPERTS, rtol=1e-2, first=9, baseline="mlm_experts", baseline_rtol=0.0),
    _mlm("mlm_deepseek", 4, _DEEPSEEK, rtol=1e-5),
    _mlm("mlm_deepseek_ep_overlap", 4, _DEEPSEEK_OVERLAP, rtol=1e-2),
)})


def by_world_size(world_size: int) -> list[Config]:
    """Configurations of one world size, in the order they must run (saves before resumes)."""
    return [c for c in CONFIGS.values() if c.world_size == world_size]

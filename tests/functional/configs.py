"""The functional-regression configurations: tiny GPTs trained for a few dozen iterations on CPU.

Each entry: world size, the ``pretrain_gpt.py`` flags beyond ``COMMON``, and the
tolerance its golden values are compared with. ``{ckpt}`` in flags is replaced
by a checkpoint directory of this world size, ``{ckpt2}`` by the 2-rank one
(``resume_*`` continue what ``save_*`` wrote; the 2-rank group runs first).
"""

from __future__ import annotations

from dataclasses import dataclass

ITERS = 16

COMMON = (
    "--mock-data --vocab-size 60 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0 --log-interval 4 "
    "--make-vocab-size-divisible-by 16 --seed 42"
).split()

FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy".split()


@dataclass(frozen=True)
class Config:
    name: str
    world_size: int
    flags: tuple[str, ...]
    rtol: float  # against the golden values (and against the DDP baseline, for FSDP runs)
    baseline: str | None = None  # the run it must agree with (this world size's, else its golden values)
    first_iteration: int = 1
    last_iteration: int = ITERS

    def argv(self, ckpt_root: str) -> list[str]:
        flags = [f.replace("{ckpt}", f"{ckpt_root}/w{self.world_size}").replace("{ckpt2}", f"{ckpt_root}/w2")
                 for f in self.flags]
        return [*COMMON, "--train-iters", str(ITERS), *flags]


def _cfg(name, world, flags, rtol=1e-5, baseline=None, first=1, last=ITERS) -> Config:
    return Config(name, world, tuple(flags.split()), rtol, baseline, first, last)


CONFIGS: dict[str, Config] = {c.name: c for c in (
    _cfg("ddp", 2, ""),
    _cfg("optim", 2, " ".join([*FSDP, "optim"]), baseline="ddp"),
    _cfg("optim_grads", 2, " ".join([*FSDP, "optim_grads"]), baseline="ddp"),
    _cfg("optim_grads_params", 2, " ".join([*FSDP, "optim_grads_params"]), baseline="ddp"),
    _cfg("meta_init", 2, " ".join([*FSDP, "optim_grads_params", "--init-model-with-meta-device"]),
         baseline="ddp"),
    _cfg("bf16", 2, " ".join([*FSDP, "optim_grads_params", "--bf16"]), rtol=1e-2, baseline="ddp_bf16"),
    _cfg("ddp_bf16", 2, "--bf16", rtol=1e-2),
    # Stop at 8 (the schedule still spans 16 iterations), resume: the uninterrupted run's losses, exactly.
    _cfg("save_zero3", 2, " ".join([*FSDP, "optim_grads_params", "--save {ckpt} --save-interval 4 --exit-interval 8"]),
         baseline="optim_grads_params", last=8, rtol=0.0),
    _cfg("resume_zero3", 2, " ".join([*FSDP, "optim_grads_params", "--load {ckpt}"]), baseline="optim_grads_params",
         first=9, rtol=0.0),
    _cfg("ddp_4", 4, ""),
    _cfg("hsdp_4", 4, " ".join([*FSDP, "optim_grads_params", "--num-distributed-optimizer-instances 2"]),
         baseline="ddp_4"),
    _cfg("hsdp_optim_4", 4, " ".join([*FSDP, "optim_grads_params", "--num-distributed-optimizer-instances 2",
                                       "--outer-dp-sharding-strategy optim"]), baseline="ddp_4"),
    _cfg("optim_grads_params_4", 4, " ".join([*FSDP, "optim_grads_params"]), baseline="ddp_4"),
    # The 2-rank ZeRO-3 checkpoint resumed at 4 ranks with ZeRO-1: the 2-rank run's curve continues.
    _cfg("resume_4_from_2_optim", 4, " ".join([*FSDP, "optim", "--load {ckpt2}"]), baseline="optim_grads_params",
         first=9),
)}


def by_world_size(world_size: int) -> list[Config]:
    """Configurations of one world size, in the order they must run (saves before resumes)."""
    return [c for c in CONFIGS.values() if c.world_size == world_size]

"""The front-end's model (megatron-core's GPTModel from the flags) and LR schedule (megatron-core's
OptimizerParamScheduler as the front-end builds it): variants train, attention is causal, schedule shapes,
weight-decay groups, the check at --load. Meta-device init of megatron-core's model: tests/distributed/mcore."""

from __future__ import annotations

import argparse

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.errors import UsageValueError
from megatron.training.model_setup import build_adamw, build_optimizer_param_scheduler, check_scheduler_state
from tests.unit.frontend.mcore_helpers import small


def scheduler_for(optimizer: torch.optim.Optimizer, *, max_lr: float, min_lr: float, warmup_steps: int,
                  decay_steps: int, decay_style: str, wsd_decay_steps: int | None = None,
                  wsd_decay_style: str = "exponential", override_opt_param_scheduler: bool = False,
                  use_checkpoint_opt_param_scheduler: bool = False, weight_decay: float = 0.0,
                  ) -> OptimizerParamScheduler:
    """megatron-core's scheduler as pretrain() builds it from these flags' values."""
    args = argparse.Namespace(
        lr=max_lr, min_lr=min_lr, lr_warmup_iters=warmup_steps, lr_decay_iters=decay_steps, lr_decay_style=decay_style,
        lr_wsd_decay_iters=wsd_decay_steps, lr_wsd_decay_style=wsd_decay_style, weight_decay=weight_decay,
        override_opt_param_scheduler=override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler)
    return build_optimizer_param_scheduler(args, optimizer)


def _stepped(sched: OptimizerParamScheduler) -> float:
    sched.step(increment=1)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("flags", [
    (), ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"),
    ("--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
     "--ffn-hidden-size", "40"),
])
def test_variants_train(one_gloo_rank, flags):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch.manual_seed(0)
    model = small(*flags)
    tokens = torch.randint(0, 50, (2, 16))
    positions = torch.arange(15).expand(2, 15)
    losses = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
    assert losses.shape == (2, 15)
    losses.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len([m for m in model.modules() if isinstance(m, TransformerLayer)]) == 2
    assert (model.output_layer.weight is None) == ("--untie-embeddings-and-output-weights" not in flags)


def test_causal(one_gloo_rank):
    torch.manual_seed(0)
    model = small("--position-embedding-type", "rope").eval()
    tokens = torch.randint(0, 50, (1, 10))
    positions = torch.arange(10).expand(1, 10)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens, positions, None), model(changed, positions, None)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_megatron_core_model_honours_the_cheap_architecture_flags(one_gloo_rank):
    torch.manual_seed(0)
    model = small("--kv-channels", "4", "--disable-bias-linear", "--qk-layernorm", "--norm-epsilon", "1e-6",
                  "--normalization", "RMSNorm", "--num-experts", "2", "--moe-layer-freq", "[0,1]",
                  "--position-embedding-type", "none", "--no-bias-gelu-fusion")
    layers = model.decoder.layers
    attn = layers[0].self_attention
    assert attn.linear_qkv.weight.shape == (3 * 4 * 4, 32) and attn.linear_proj.weight.shape == (32, 16)  # kv-channels
    assert attn.linear_qkv.bias is None and attn.linear_proj.bias is None and layers[0].mlp.linear_fc1.bias is None
    assert attn.q_layernorm.eps == 1e-6 and attn.q_layernorm.weight.shape == (4,)
    assert type(layers[0].mlp).__name__ == "MLP" and type(layers[1].mlp).__name__ == "MoELayer"
    assert not hasattr(model.embedding, "position_embeddings")
    tokens = torch.randint(0, 50, (2, 16))
    losses = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
    assert losses.shape == (2, 16) and torch.isfinite(losses).all()


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_schedule(style):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_for(opt, max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style=style)
    lrs = [opt.param_groups[0]["lr"]] + [_stepped(sched) for _ in range(12)]
    assert lrs[:3] == [0.0, 0.5, 1.0]
    if style == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[10] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    if style == "cosine":
        assert lrs[6] == pytest.approx(0.55)
    resumed = scheduler_for(opt, max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style=style)
    resumed.load_state_dict(sched.state_dict())
    assert opt.param_groups[0]["lr"] == lrs[-1]


def test_no_decay_group_keeps_zero_weight_decay():
    """megatron-core's scheduler writes weight_decay x wd_mult into every group at every step: Megatron's
    no-decay group (biases, norms) has wd_mult 0."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    args = argparse.Namespace(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.1)
    opt = build_adamw(args, model)
    sched = scheduler_for(opt, max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=4, decay_style="linear",
                          weight_decay=0.1)
    for _ in range(3):
        sched.step(increment=1)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
        assert all(len(g["params"]) for g in opt.param_groups)


def test_schedule_at_load_follows_megatron_lm_rule():
    """A checkpoint's other schedule is refused unless --override-opt_param-scheduler (the flags win) or
    --use-checkpoint-opt_param-scheduler (the checkpoint wins); both at once contradict each other."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    def sched(decay_steps: int, **flags) -> OptimizerParamScheduler:
        return scheduler_for(opt, max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=decay_steps,
                             decay_style="linear", **flags)

    saved = sched(4)
    saved.step(increment=1)
    saved.step(increment=1)
    state = saved.state_dict()
    with pytest.raises(UsageValueError, match=r"--lr-decay-iters \(default --train-iters\) 4 \(saved\) vs 6 \(now\)"):
        check_scheduler_state(sched(6), state, "--load x")
    override = sched(6, override_opt_param_scheduler=True)
    check_scheduler_state(override, state, "--load x")
    override.load_state_dict(state)
    assert (override.num_steps, override.lr_decay_steps) == (2, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 2 / 6))
    use_checkpoint = sched(6, use_checkpoint_opt_param_scheduler=True)
    use_checkpoint.load_state_dict(state)
    assert (use_checkpoint.num_steps, use_checkpoint.lr_decay_steps) == (2, 4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 2 / 4))
    with pytest.raises(UsageValueError, match="contradict each other"):
        sched(6, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)
    with pytest.raises(UsageValueError, match=r"--weight-decay 0.0 \(saved\) vs 0.1 \(now\)"):
        check_scheduler_state(sched(4, weight_decay=0.1), state, "--load x")


def test_scheduler_state_saved_before_megatron_cores_loads():
    """Checkpoints of this project written with its own scheduler (keys warmup_steps, decay_steps, decay_style)
    load into megatron-core's, which reads those names; a differing schedule is still named."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    old_state = {"num_steps": 3, "max_lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "decay_steps": 10,
                 "decay_style": "cosine", "wsd_decay_steps": None, "wsd_decay_style": "exponential"}
    sched = scheduler_for(opt, max_lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, decay_style="cosine")
    check_scheduler_state(sched, old_state, "--load old")
    sched.load_state_dict(old_state)
    fresh = scheduler_for(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), max_lr=1e-3, min_lr=1e-4,
                          warmup_steps=1, decay_steps=10, decay_style="cosine")
    for _ in range(3):
        fresh.step(increment=1)
    assert sched.num_steps == 3 and opt.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]
    other = scheduler_for(opt, max_lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=12, decay_style="cosine")
    with pytest.raises(UsageValueError, match=r"--lr-decay-iters \(default --train-iters\) 10 \(saved\) vs 12"):
        check_scheduler_state(other, old_state, "--load old")


def test_mcore_provider_builds_megatron_core_gpt(nccl_group):
    """megatron-core's GPTModel on CUDA (runs only where CUDA is)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not on this environment's path")
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.mcore_model import mcore_gpt_model

    args = validate_args(parse_args(["--mock-data", "--vocab-size", "63",
                                     "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]), 1)
    args.padded_vocab_size = 64
    model = mcore_gpt_model(args).cuda()
    tokens = torch.randint(0, 63, (2, 16), device="cuda")
    positions = torch.arange(16, device="cuda").expand(2, 16)
    losses = model(tokens, positions, None, labels=tokens)
    assert losses.shape == (2, 16) and torch.isfinite(losses).all()

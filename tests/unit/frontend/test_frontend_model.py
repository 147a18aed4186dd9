"""The front-end's GPT and LR schedule: variants run, meta-init equals eager init, schedule shapes."""

from __future__ import annotations

import pytest
import torch

from megatron.training.errors import UsageValueError
from megatron.training.gpt_model import GPTConfig, GPTModel, TransformerLayer
from megatron.training.optimizer_param_scheduler import OptimizerParamScheduler


def small(**overrides) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, max_position_embeddings=16,
                attention_dropout=0.0, hidden_dropout=0.0)
    return GPTConfig(**{**base, **overrides})


@pytest.mark.parametrize("overrides", [
    {}, {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True},
    {"num_query_groups": 2, "untie_embeddings_and_output_weights": True, "ffn_hidden_size": 40},
])
def test_variants_train(overrides):
    torch.manual_seed(0)
    model = GPTModel(small(**overrides))
    tokens = torch.randint(0, 50, (2, 16))
    losses = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert losses.shape == (2, 15)
    losses.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len([m for m in model.modules() if isinstance(m, TransformerLayer)]) == 2
    assert (model.output_layer is None) == (not overrides.get("untie_embeddings_and_output_weights", False))


def test_causal():
    torch.manual_seed(0)
    model = GPTModel(small(position_embedding_type="rope")).eval()
    tokens = torch.randint(0, 50, (1, 10))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_megatron_init_and_meta_equals_eager():
    torch.manual_seed(3)
    eager = GPTModel(small(num_layers=4, init_method_std=0.05))
    assert abs(eager.layers[0].attention.qkv.weight.std().item() - 0.05) < 0.01
    assert abs(eager.layers[0].mlp.fc2.weight.std().item() - 0.05 / 8**0.5) < 0.005
    assert torch.all(eager.layers[0].mlp.fc1.bias == 0)
    with torch.device("meta"):
        meta = GPTModel(small(num_layers=4, init_method_std=0.05))
    meta = meta.to_empty(device="cpu")
    torch.manual_seed(3)
    for module in meta.modules():  # pre-order, what megatron_fsdp.materialize_meta does
        if hasattr(module, "reset_parameters") and next(module.parameters(recurse=False), None) is not None:
            module.reset_parameters()
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name


def test_config_errors():
    with pytest.raises(ValueError, match="--num-query-groups"):
        small(num_query_groups=3)
    with pytest.raises(ValueError, match="--hidden-size"):
        small(hidden_size=30)
    with pytest.raises(ValueError, match="max-position-embeddings"):
        GPTModel(small())(torch.zeros(1, 20, dtype=torch.long))
    # API users get the flag checks too: 0 is not "the default", a bad std or dropout names its flag
    for overrides, flag in (({"ffn_hidden_size": 0}, "--ffn-hidden-size must be positive, got 0"),
                            ({"num_query_groups": 0}, "--num-query-groups must be positive"),
                            ({"init_method_std": -0.1}, "--init-method-std"),
                            ({"attention_dropout": 1.5}, r"--attention-dropout must be in \[0, 1\)"),
                            ({"hidden_dropout": -0.5}, "--hidden-dropout")):
        with pytest.raises(ValueError, match=flag):
            small(**overrides)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_schedule(style):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style=style)
    lrs = [opt.param_groups[0]["lr"]] + [sched.step() for _ in range(12)]
    assert lrs[:3] == [0.0, 0.5, 1.0]
    if style == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[10] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    if style == "cosine":
        assert lrs[6] == pytest.approx(0.55)
    resumed = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style=style)
    resumed.load_state_dict(sched.state_dict())
    assert opt.param_groups[0]["lr"] == lrs[-1]


def test_schedule_at_load_follows_megatron_lm_rule():
    """A checkpoint's other schedule is refused unless --override-opt_param-scheduler (the flags win) or
    --use-checkpoint-opt_param-scheduler (the checkpoint wins); both at once contradict each other."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    def sched(decay_steps: int, **flags) -> OptimizerParamScheduler:
        return OptimizerParamScheduler(opt, max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=decay_steps,
                                       decay_style="linear", **flags)

    saved = sched(4)
    saved.step()
    saved.step()
    state = saved.state_dict()
    with pytest.raises(UsageValueError, match=r"--lr-decay-iters \(default --train-iters\) 4 \(saved\) vs 6 \(now\)"):
        sched(6).load_state_dict(state)
    override = sched(6, override_opt_param_scheduler=True)
    override.load_state_dict(state)
    assert (override.num_steps, override.decay_steps) == (2, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 2 / 6))
    use_checkpoint = sched(6, use_checkpoint_opt_param_scheduler=True)
    use_checkpoint.load_state_dict(state)
    assert (use_checkpoint.num_steps, use_checkpoint.decay_steps) == (2, 4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 2 / 4))
    with pytest.raises(UsageValueError, match="contradict each other"):
        sched(6, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)


def test_mcore_provider_builds_megatron_core_gpt(nccl_group):
    """--model-provider mcore: megatron-core's GPTModel (runs only where megatron-core and CUDA are)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not on this environment's path")
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.mcore_model import mcore_gpt_model

    args = validate_args(parse_args(["--mock-data", "--vocab-size", "63", "--model-provider", "mcore",
                                     "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]), 1)
    args.padded_vocab_size = 64
    model = mcore_gpt_model(args).cuda()
    tokens = torch.randint(0, 63, (2, 16), device="cuda")
    positions = torch.arange(16, device="cuda").expand(2, 16)
    losses = model(tokens, positions, None, labels=tokens)
    assert losses.shape == (2, 16) and torch.isfinite(losses).all()

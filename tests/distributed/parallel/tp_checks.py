"""Megatron-style tensor, sequence and context parallelism (megatron_fsdp.parallel) against the unsplit model.

Each check builds the same GPT twice from one seed, unsplit and split across a
``(cp, tp)`` mesh of the ranks, and compares losses and gradients: a TP rank's
gradient must be its slice of the unsplit gradient; CP ranks' gradients summed must
be the unsplit one. fp32; tolerance 1e-5 relative to the largest value (partial
products and softmax terms are summed in another order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.overrides import TorchFunctionMode

from megatron.training.gpt_model import GPTConfig, GPTModel
from megatron_fsdp import FSDPModule, comm_stats, fully_shard
from megatron_fsdp.optim.grad_norm import get_grad_norm
from megatron_fsdp.parallel import (
    ContextParallel,
    TensorParallel,
    allreduce_sequence_parallel_grads,
    model_parallel_stats,
    params_for_grad_norm,
    vocab_parallel_cross_entropy,
)
from megatron_fsdp.parallel.tp_group import take_partition
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check, device, device_type

SUITE = "tp"
RTOL = 1e-5
VARIANTS = {
    "plain": dict(),
    "gqa_swiglu_rope_untied": dict(num_query_groups=2, swiglu=True, position_embedding_type="rope",
                                   untie_embeddings_and_output_weights=True, normalization="RMSNorm"),
}


def _config(**overrides) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=32, max_position_embeddings=8,
                attention_dropout=0.0, hidden_dropout=0.0, ffn_hidden_size=24)
    return GPTConfig(**{**base, **overrides})


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= RTOL, f"{what}: max relative difference {error:.3g} > {RTOL}"


def _segments(name: str, config: GPTConfig) -> tuple[int, ...] | None:
    """How the unsplit weight is partitioned (fused QKV and SwiGLU FC1 split per part)."""
    head_dim = config.hidden_size // config.num_attention_heads
    if "qkv" in name:
        q, kv = config.num_attention_heads * head_dim, config.query_groups * head_dim
        return (q, kv, kv)
    if "fc1" in name and config.swiglu:
        return (config.ffn_size, config.ffn_size)
    return None


def _groups(tp_size: int, cp_size: int, sequence_parallel: bool) -> tuple[TensorParallel, ContextParallel]:
    mesh = init_device_mesh(device_type(), (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
    return (TensorParallel.from_group(mesh.get_group("tp"), sequence_parallel),
            ContextParallel.from_group(mesh.get_group("cp")))


def _pair(variant: str, sequence_parallel: bool, tp_size: int | None = None, cp_size: int = 1
          ) -> tuple[GPTConfig, GPTModel, GPTModel, TensorParallel, ContextParallel]:
    config = _config(**VARIANTS[variant])
    tp_size = dist.get_world_size() // cp_size if tp_size is None else tp_size
    tp, cp = _groups(tp_size, cp_size, sequence_parallel)
    torch.manual_seed(7)
    full = GPTModel(config)
    torch.manual_seed(7)
    split = GPTModel(config, tp, cp)
    return config, full, split, tp, cp


def _compare(variant: str, sequence_parallel: bool, tp_size: int | None = None, cp_size: int = 1) -> None:
    config, full, split, tp, cp = _pair(variant, sequence_parallel, tp_size, cp_size)
    what = f"{variant} tp={tp.size} cp={cp.size} sp={tp.sequence_parallel}"
    g = torch.Generator().manual_seed(3)  # the same batch on every rank (one data-parallel rank)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=g)
    full_losses = full(tokens[:, :-1], labels=tokens[:, 1:])
    split_losses = split(cp.split(tokens[:, :-1]), labels=cp.split(tokens[:, 1:]))  # this CP rank's tokens
    _close(split_losses, cp.split(full_losses), f"{what}: per-token losses")
    full_losses.mean().backward()
    (split_losses.sum() / full_losses.numel()).backward()  # this CP rank's share of the mean
    for param in split.parameters():  # CP ranks' shares summed (what the gradient reduction over CP does)
        if cp.size > 1:
            dist.all_reduce(param.grad, group=cp.group)
    allreduce_sequence_parallel_grads(list(split.parameters()), tp)
    full_params = dict(full.named_parameters())
    for name, param in split.named_parameters():
        reference = full_params[name]
        if getattr(param, "tensor_model_parallel", False):
            dim, segments = param.partition_dim, _segments(name, config)
            _close(param.detach(), take_partition(reference.detach(), tp, dim, segments), f"{what}: {name} slice")
            _close(param.grad, take_partition(reference.grad, tp, dim, segments), f"{what}: {name} gradient slice")
        else:
            _close(param.detach(), reference.detach(), f"{what}: {name} (TP-replicated) weight")
            _close(param.grad, reference.grad, f"{what}: {name} (TP-replicated) gradient")
    group = tp.group if tp.size > 1 else None
    norm = get_grad_norm(params_for_grad_norm(list(split.parameters()), tp), model_parallel_group=group)
    _close(norm, get_grad_norm(list(full.parameters())), f"{what}: global gradient norm counted once")


@check(SUITE, world_sizes=(2,))
def tp_gpt_matches_unsplit_model():
    for variant in VARIANTS:
        _compare(variant, sequence_parallel=False)


@check(SUITE, world_sizes=(2,))
def sp_gpt_matches_unsplit_model():
    for variant in VARIANTS:
        _compare(variant, sequence_parallel=True)


@check(SUITE, world_sizes=(2,))
def cp_gpt_matches_unsplit_model():
    for variant in VARIANTS:
        _compare(variant, sequence_parallel=False, tp_size=1, cp_size=2)


@check(SUITE, world_sizes=(4,))
def tp2_cp2_sp_gpt_matches_unsplit_model():
    for variant in VARIANTS:
        _compare(variant, sequence_parallel=True, tp_size=2, cp_size=2)


@check(SUITE, world_sizes=(2,))
def context_parallel_split_is_load_balanced():
    cp = _groups(1, 2, False)[1]
    assert cp.sequence_indices(8, rank=0).tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert cp.sequence_indices(8, rank=1).tolist() == [2, 3, 4, 5]
    assert cp.gathered_indices(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    expect_error(ValueError, "divisible by 2 x --context-parallel-size (4)", cp.sequence_indices, 6)


@check(SUITE, world_sizes=(2,))
def replicated_parameters_carry_megatron_attributes():
    _, _, split, _, _ = _pair("plain", sequence_parallel=True)
    attrs = {name: (getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                    getattr(p, "sequence_parallel", None)) for name, p in split.named_parameters()}
    assert attrs["layers.0.attention.qkv.weight"][:2] == (True, 0)
    assert attrs["layers.0.attention.proj.weight"][:2] == (True, 1)
    assert attrs["layers.0.attention.proj.bias"] == (False, 0, True)  # row-parallel bias: summed over TP under SP
    assert attrs["layers.0.input_norm.weight"][2] is True and attrs["final_norm.bias"][2] is True
    assert attrs["word_embeddings.weight"][:2] == (True, 0)


@check(SUITE, world_sizes=(2,))
def vocab_parallel_cross_entropy_matches_full_softmax():
    tp = TensorParallel.from_group(dist.group.WORLD)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 5, 10, generator=g) * 4).requires_grad_()
    target = torch.randint(0, 10, (3, 5), generator=g)
    expected = F.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), reduction="none").view(3, 5)
    local = take_partition(logits.detach(), tp, 2).requires_grad_()
    losses = vocab_parallel_cross_entropy(local, target, tp)
    _close(losses, expected, "per-token losses")
    weights = torch.rand(3, 5, generator=g)
    (expected * weights).sum().backward()
    (losses * weights).sum().backward()
    _close(local.grad, take_partition(logits.grad, tp, 2), "logit gradients")


@check(SUITE, world_sizes=(2,))
def meta_init_gives_the_eager_slices():
    config = _config(**VARIANTS["gqa_swiglu_rope_untied"])
    tp = TensorParallel.from_group(dist.group.WORLD, sequence_parallel=True)
    torch.manual_seed(11)
    eager = GPTModel(config, tp)
    torch.manual_seed(11)
    with torch.device("meta"):
        meta = GPTModel(config, tp)
    meta.to_empty(device=device())
    for module in meta.modules():  # pre-order, as materialize_meta does
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (name, a), b in zip(eager.named_parameters(), meta.parameters()):
        assert torch.equal(a, b), name


@check(SUITE, world_sizes=(2,))
def sizes_that_do_not_divide_name_their_flag():
    tp = TensorParallel.from_group(dist.group.WORLD)
    for overrides, flag in ((dict(num_attention_heads=3, hidden_size=15), "--num-attention-heads"),
                            (dict(num_query_groups=1), "--num-query-groups"),
                            (dict(ffn_hidden_size=25), "--ffn-hidden-size"),
                            (dict(vocab_size=33), "vocabulary")):
        try:
            GPTModel(_config(**overrides), tp)
        except ValueError as error:
            assert flag in str(error) and "--tensor-model-parallel-size (2)" in str(error), error
        else:
            raise AssertionError(f"{overrides}: no error")


@check(SUITE, world_sizes=(4,))
def fsdp_bytes_at_tp2_dp2_are_the_zero3_minimum_of_the_slice():
    """TP2 x DP2, ZeRO-3 per layer: the engine's bytes per step are the ZeRO-3 minimum of this TP
    rank's slice (gathers twice for non-root units, one reduce-scatter), and the TP collectives
    are counted apart (model_parallel_stats): 2 + 4 x layers activation all-reduces plus the
    vocabulary-parallel cross-entropy's 3 per-token ones, and nothing else."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    tp = TensorParallel.from_group(mesh.get_group("tp"))
    config = _config()
    torch.manual_seed(7)
    model = GPTModel(config, tp).to(device())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    batch, seq = 2, 8
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # data differs over DP, not over TP
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g).to(device())

    def step() -> None:
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()

    step()  # lazy init
    comm_stats.reset()
    model_parallel_stats.reset()
    step()
    gather = reduce = sharded = padding = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            unit = module.fsdp_unit
            for group in unit.groups:
                sharded += group.layout.param_numel
                padding += group.layout.padding_numel
                nbytes = group.layout.total_numel * group.shard.element_size()
                gather += nbytes if unit.is_root else 2 * nbytes
                reduce += nbytes if group.requires_grad else 0
    fsdp = {k: v for k, v in comm_stats.bytes.items() if k != "control"}
    assert fsdp == {"all_gather": gather, "reduce_scatter": reduce}, (fsdp, gather, reduce)
    activation = batch * seq * config.hidden_size * 4
    expected_tp = (2 + 4 * config.num_layers) * activation + 3 * batch * seq * 4
    assert dict(model_parallel_stats.bytes) == {"tp_all_reduce": expected_tp}, (
        dict(model_parallel_stats.bytes), expected_tp)
    # FSDP shards this TP rank's slice (TP-sharded weights at half size, replicated ones whole),
    # not the full model; the gathered bytes above are that slice plus the layout's row padding.
    local = sum(p.numel() for p in GPTModel(config, tp).parameters())
    full = sum(p.numel() for p in GPTModel(config).parameters())
    assert sharded == local < full, (sharded, local, full)
    assert padding <= 0.05 * local, (padding, local)


def _rng_state() -> torch.Tensor:
    """The default generator of this rank's device (what dropout kernels draw from)."""
    return torch.cuda.get_rng_state() if device_type() == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    torch.cuda.set_rng_state(state) if device_type() == "cuda" else torch.set_rng_state(state)


class _DropoutMasks(TorchFunctionMode):
    """Records the mask of every dropout a forward draws, in call order: ``(kind, mask)``.

    Each call is replayed at the generator state it started from on probe inputs of the
    same shapes (the same kernel, the same draws): ``F.dropout`` on ones gives its mask;
    attention (``scaled_dot_product_attention``) with zero queries and keys and fixed
    values gives outputs that are a fixed function of its dropout mask (equal masks,
    equal outputs). The generator is then left where the real call left it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[str, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if not training or p == 0:
                return func(*args, **kwargs)
            before = _rng_state()
            out = func(*args, **kwargs)
            after = _rng_state()
            _set_rng_state(before)
            self.masks.append(("dropout", func(torch.ones_like(args[0]), p, True) != 0))
        elif func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            before = _rng_state()
            out = func(*args, **kwargs)
            after = _rng_state()
            _set_rng_state(before)
            q, k, v = args[:3]
            probe = torch.rand(v.shape, generator=torch.Generator().manual_seed(0)).to(v)
            self.masks.append(("attention", func(torch.zeros_like(q), torch.zeros_like(k), probe, **kwargs)))
        else:
            return func(*args, **kwargs)
        _set_rng_state(after)
        return out


@check(SUITE, world_sizes=(2, 4), params={"sequence_parallel": [False, True]})
def dropout_masks_follow_megatrons_rng_rules(sequence_parallel: bool):
    """TP2 (x DP2 at 4 ranks), dropout 0.5: where megatron-core forks its model-parallel RNG (seed + 2718 +
    TP rank), masks differ across TP ranks: attention dropout (each rank's own heads) always, and under
    sequence parallelism the embedding and hidden dropouts (each rank's own tokens). Without it those act
    on activations every TP rank holds alike, draw from the default generator and agree. Data-parallel
    replicas draw alike (Megatron's seeds do not depend on the DP rank), and TP ranks' default generators
    stay in step (under SP the forward draws nothing from it at all)."""
    mesh = init_device_mesh(device_type(), (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = TensorParallel.from_group(mesh.get_group("tp"), sequence_parallel)
    config = _config(attention_dropout=0.5, hidden_dropout=0.5, max_position_embeddings=16)
    torch.manual_seed(7)
    model = GPTModel(config, tp).to(device()).train()
    from megatron.core import tensor_parallel

    from megatron.training.mcore_cpu_compat import apply_cpu_compat, cuda_absent

    if cuda_absent():
        apply_cpu_compat()
    # megatron-core's tracker, as pretrain seeds it (it seeds the default generator with 1234 too)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=tp.rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3)).to(device())
    default_before = _rng_state()
    try:
        with _DropoutMasks() as recorder:
            model(tokens)
        with _DropoutMasks() as again:
            model(tokens)
    finally:
        tensor_parallel.get_cuda_rng_tracker().reset()
    kinds = [kind for kind, _ in recorder.masks]
    assert kinds == ["dropout"] + ["attention", "dropout", "dropout"] * config.num_layers, kinds
    names = ["embedding"] + [f"layer {i} {k}" for i in range(config.num_layers)
                             for k in ("attention", "hidden after attention", "hidden after MLP")]
    mine = [m.cpu() for _, m in recorder.masks]
    for name, a, (_, b) in zip(names, mine, again.masks):  # the streams go on: a second forward draws anew
        assert not torch.equal(a, b.cpu()), f"{name}: the second forward repeated the first one's mask"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, _rng_state().cpu()))
    theirs, their_default = everyone[mesh["tp"].mesh.tolist()[1 - tp.rank]]
    for name, kind, a, b in zip(names, kinds, mine, theirs):
        forked = kind == "attention" or sequence_parallel
        agree = torch.equal(a, b)
        what = "agree" if agree else "differ"
        assert agree != forked, f"{name}: masks {what} across TP ranks (sequence parallel: {sequence_parallel})"
        if kind == "dropout":
            assert 0.3 < a.float().mean() < 0.7, f"{name}: kept {a.float().mean():.2f} of the values at p=0.5"
    assert torch.equal(_rng_state().cpu(), their_default), "TP ranks' default generators drifted apart"
    if sequence_parallel:  # every dropout forked: the default stream did not move
        assert torch.equal(_rng_state(), default_before), "a sequence-parallel forward drew from the default generator"
    for rank in mesh["dp"].mesh.tolist():  # this TP rank in every data-parallel replica: the same masks
        for name, a, b in zip(names, mine, everyone[rank][0]):
            assert torch.equal(a, b), f"{name}: masks differ between data-parallel ranks {dist.get_rank()} and {rank}"

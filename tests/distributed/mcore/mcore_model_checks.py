"""megatron-core's own GPTModel under our adapter vs megatron-core's DistributedDataParallel and torch DDP.

Runs with megatron-core 0.16.1 (installed in the venv by .ci/setup.sh; tests/distributed/mcore/
test_mcore_model.py runs it in a separate process). The model is built by the front-end
(``megatron/training/mcore_model.py``: Megatron's flag-to-TransformerConfig mapping, the local
layer spec, on CPU through ``mcore_cpu_compat``) with dropout on: every arm reseeds the CPU
generator and megatron-core's RNG tracker before each step, so all draw the same masks.

Bitwise at 2 data-parallel ranks (TP2 x DP2 included): fp32 parameters after several AdamW
steps, and every step's loss, equal across arms; at 4 data-parallel ranks within 1e-6 (``exact()``).
With --bf16 (``BF16_RTOL``): bitwise at 2 ranks too, 1e-2 at 4. The 2-rank group leaves a checkpoint that the
4-rank group resumes at twice the data-parallel size (``HANDOFF_ENV``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel as McoreDDP
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, reset_model_temporary_tensors
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
    track_moe_metrics,
)
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron.training.arguments import parse_args, validate_args
from megatron.training.data_loader import build_train_valid_test_data_iterators
from megatron.training.global_vars import get_args
from megatron.training.mcore_model import (
    destroy_mcore_parallel,
    initialize_mcore_parallel,
    mcore_gpt_model,
    transformer_config_from_args,
)
from megatron.training.model_setup import build_adamw, pad_vocab_size
from megatron_fsdp import FSDPModule, microbatch
from megatron_fsdp.mcore import FullyShardedDataParallel
from tests.distributed.harness import check, shared_tmpdir

SUITE = "mcore_model"


# megatron-core's fused functions (bias-dropout-add, bias-GeLU, SwiGLU, the MoE router's) are torch.compile'd
# (megatron.core.jit.jit_fuser), and each new guard set they meet (another dropout probability, dtype, shape or
# training flag) compiles them again: most of this suite's time on 2 loaded cores (after 8 recompiles of one
# function dynamo runs it eagerly anyway: its recompile_limit). The checks marked ``@compiling`` (the dense and
# the MoE model under every strategy) compile them as before; the others run the compiled code wherever its
# guards hold and eagerly where it would recompile ("eager_on_recompile"). Every arm of a check meets the same
# guards, so the arms compute alike either way.
torch.compiler.set_stance("eager_on_recompile")


def compiling(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with torch.compile compiling what it meets (the default stance), not only reusing compiled code."""

    @functools.wraps(fn)
    def run(*args, **kwargs) -> None:
        with torch.compiler.set_stance("default"):
            fn(*args, **kwargs)

    return run


STEPS = 6
SEQ = 12
VOCAB = 61  # odd rows: shards that do not divide evenly
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def model_args(*flags: str):
    argv = ["--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1", "--num-layers", "2",
            "--hidden-size", "16", "--ffn-hidden-size", "24", "--num-attention-heads", "4", "--seq-length",
            str(SEQ), "--model-provider", "mcore", *flags]
    args = validate_args(parse_args(argv), dist.get_world_size())
    args.padded_vocab_size = pad_vocab_size(args)
    return args


def build(args):
    """megatron-core's GPTModel, as pretrain() builds it (seeded as set_random_seed does)."""
    torch.manual_seed(args.seed)
    return mcore_gpt_model(args)


def reseed(step: int) -> None:
    torch.manual_seed(900 + step)
    tensor_parallel.model_parallel_cuda_manual_seed(900 + step, force_reset_rng=True)


def batch(step: int, dp_rank: int, dp_size: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Two batches, alternating (so that the loss, a local one per rank, must fall over the steps)."""
    g = torch.Generator().manual_seed(100 + step % 2)
    tokens = torch.randint(0, vocab, (2 * dp_size, SEQ + 1), generator=g).chunk(dp_size)[dp_rank]
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    return tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous()


def loss_of(model, step: int) -> torch.Tensor:
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tokens, positions, labels = batch(step, dp_rank, dp_size, VOCAB)
    reseed(step)
    return model(tokens, positions, None, labels=labels).mean()


def exact() -> bool:
    """Bitwise where each gradient element is a sum of two ranks' (a sum of two numbers has one order).

    Over 4 data-parallel ranks gloo's ring all-reduce adds an element's four terms in an
    order set by its position in the reduced buffer, which differs between wrappers that
    bucket differently (torch DDP and megatron-core DDP differ from each other the same
    way): there the bar is DESIGN's 1e-6, with SGD, since Adam's m / sqrt(v) turns
    last-bit gradient differences into visible ones.
    """
    return parallel_state.get_data_parallel_world_size() == 2


def optimizer(params) -> torch.optim.Optimizer:
    if exact():
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if exact():
        diff = (got - want).abs().max().item()
        assert torch.equal(got, want), f"{what} differs by up to {diff:.3g} (bitwise expected)"
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


def train_plain(model: torch.nn.Module) -> list[float]:
    """``STEPS`` plain steps of ``model`` (zero_grad, forward, backward, step): each step's loss."""
    opt, losses = optimizer(model.parameters()), []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_torch_ddp(args) -> tuple[dict, list[float]]:
    model = DDP(build(args), process_group=parallel_state.get_data_parallel_group())
    losses = train_plain(model)
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}, losses


def mcore_ddp(args) -> McoreDDP:
    module = build(args)
    return McoreDDP(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)


def main_grads_to_grads(model: McoreDDP) -> None:
    """What Megatron's optimizer does before stepping: the reduced main_grad is the gradient."""
    for param in model.module.parameters():
        param.grad = param.main_grad


def _finish(model: McoreDDP) -> None:
    model.finish_grad_sync()
    main_grads_to_grads(model)


def train_mcore_ddp(args, finish: Callable[[McoreDDP], None] = _finish) -> tuple[dict, list[float]]:
    """Megatron's loop over megatron-core DDP; ``finish``: after the backward, before the step (its default:
    finish_grad_sync, the reduced main_grad as the gradient)."""
    model = mcore_ddp(args)
    opt, losses = optimizer(model.module.parameters()), []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        finish(model)
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}, losses


def ours(args, strategy: str, instances: int = 1, mesh=None) -> FullyShardedDataParallel:
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                               num_distributed_optimizer_instances=instances)
    module = build(args)
    return FullyShardedDataParallel(module.config, ddp_config, module, device_mesh=mesh)


def train_wrapped(model: FullyShardedDataParallel, after_sync: Callable[[FullyShardedDataParallel], None] | None = None
                  ) -> tuple[dict, list[float]]:
    """Megatron's loop calls on our adapter for ``STEPS`` steps: the full parameters after them, and each loss.
    ``after_sync``: what the loop does after finish_grad_sync (the sum over TP of sequence-parallel gradients)."""
    opt, losses = optimizer(model.parameters()), []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        with microbatch(model, is_first=True, is_last=True):
            loss = loss_of(model, step)
            loss.backward()
        model.finish_grad_sync()
        if after_sync is not None:
            after_sync(model)
        opt.step()
        model.start_param_sync()
        losses.append(loss.item())
    return {n: p.full_tensor().detach().clone() for n, p in model.module.module.named_parameters()}, losses


def train_ours(args, strategy: str, instances: int = 1, mesh=None) -> tuple[dict, list[float]]:
    model = ours(args, strategy, instances, mesh)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == 2 and all(isinstance(m, FSDPModule) for m in layers), "megatron-core's layers are units"
    return train_wrapped(model)


def assert_same(what: str, got: tuple[dict, list[float]], want: tuple[dict, list[float]]) -> None:
    """Every parameter after the steps, and every step's loss, equal (bitwise or 1e-6: ``exact()``)."""
    params, losses = got
    ref_params, ref_losses = want
    assert params.keys() == ref_params.keys(), f"{what}: {sorted(params)} vs {sorted(ref_params)}"
    assert_equal(f"{what}: losses", torch.tensor(losses), torch.tensor(ref_losses))
    for name, value in params.items():
        assert_equal(f"{what}: {name}", value, ref_params[name])


@check(SUITE)
@compiling
def every_strategy_equals_megatron_core_ddp() -> None:
    """Each of the four strategies (and HSDP at 4 ranks) == megatron-core DDP == torch DDP (``exact()``)."""
    args = model_args()
    model = build(args)
    assert type(model).__module__ == "megatron.core.models.gpt.gpt_model", type(model)
    reference = train_mcore_ddp(args)
    assert_same("torch DDP vs megatron-core DDP", train_torch_ddp(args), reference)
    assert reference[1][-1] < reference[1][0], f"the loss should fall: {reference[1]}"
    for strategy in STRATEGIES:
        assert_same(strategy, train_ours(args, strategy), reference)
    if dist.get_world_size() == 4:
        for strategy in ("optim_grads_params", "optim"):  # HSDP: 2 replicas of 2 shards
            assert_same(f"HSDP {strategy} x2", train_ours(args, strategy, instances=2), reference)


@check(SUITE, world_sizes=(4,))
def tensor_parallel_2_equals_megatron_core_ddp() -> None:
    """TP2 x DP2: megatron-core's column/row-parallel layers, our FSDP over DP == megatron-core DDP at TP2."""
    args = model_args("--tensor-model-parallel-size", "2")
    try:
        base = build(args)
        assert parallel_state.get_tensor_model_parallel_world_size() == 2
        qkv = base.decoder.layers[0].self_attention.linear_qkv.weight
        assert qkv.tensor_model_parallel and qkv.partition_dim == 0, "megatron-core's column-parallel weight"
        reference = train_mcore_ddp(args)
        assert reference[1][-1] < reference[1][0], f"the loss should fall: {reference[1]}"
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        for strategy in STRATEGIES:
            assert_same(f"TP2 {strategy}", train_ours(args, strategy, mesh=mesh), reference)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


@check(SUITE)
def loop_methods_behave_as_megatron_core_ddp() -> None:
    """no_sync accumulation, start/finish_grad_sync, zero_grad_buffer: the same gradients as megatron-core DDP."""
    args = model_args()
    theirs, mine = mcore_ddp(args), ours(args, "optim_grads_params")
    for model in (theirs, mine):
        model.zero_grad_buffer()
        with model.no_sync():  # micro-batch 1: accumulated locally, not reduced
            loss_of(model, 0).backward()
        loss_of(model, 1).backward()  # micro-batch 2: reduced (megatron-core reduces in finish_grad_sync)
        model.start_grad_sync()
        model.finish_grad_sync()
    reference = {n: p.main_grad for n, p in theirs.module.named_parameters()}
    for name, param in mine.module.module.named_parameters():
        assert_equal(f"gradient of {name}", param.grad.full_tensor(), reference[name])
    for model in (theirs, mine):
        model.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in theirs.module.parameters())
    assert all(p.grad is None for p in mine.parameters()), "zero_grad_buffer clears our gradients"


def _accumulate_two(model, step: int) -> None:
    """Megatron's two micro-batches of one step: the first under no_sync (kept locally), the second reduced
    by finish_grad_sync (megatron-core DDP and the distributed optimizer reduce-scatter there)."""
    with model.no_sync():
        loss_of(model, 2 * step).backward()
    loss_of(model, 2 * step + 1).backward()
    model.finish_grad_sync()


def _shard_step_optimizer(model: McoreDDP, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """What megatron-core's DistributedOptimizer steps for fp32 parameters, built from megatron-core DDP's own
    buffers: each parameter's elements inside this rank's shard of its bucket (views of the DDP's param_data, with
    the matching views of its reduce-scattered grad_data as gradients), under AdamW (element-wise, so a shard's
    update is the full update's). megatron-core's DistributedOptimizer itself cannot be built on CPU
    (megatron/core/optimizer/optimizer.py:473-485 allocates on device='cuda', and distrib_optimizer.py:420 accepts
    only 'torch.cuda.FloatTensor' parameters)."""
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    shards = []
    for buffer in model.buffers:
        for start, end, bucket_id in buffer.param_index_map.values():
            bucket = buffer.buckets[bucket_id]
            per_rank = bucket.grad_data.numel() // size
            lo, hi = max(start, bucket.offset + rank * per_rank), min(end, bucket.offset + (rank + 1) * per_rank)
            if lo < hi:
                shard = buffer.param_data[lo:hi]
                shard.grad = buffer.grad_data[lo:hi]
                shards.append(shard)
    assert shards, "this rank owns a shard"
    return torch.optim.AdamW(shards, lr=lr, weight_decay=weight_decay)


def _accumulate_two(model, step: int) -> None:
    """Megatron's two micro-batches of one step: the first under no_sync (kept locally), the second reduced by
    finish_grad_sync (finalize_model_grads). Megatron's schedule calls start_grad_sync only with
    overlap_grad_reduce; without it megatron-core's finish_grad_sync starts the reduction itself, so calling both
    would reduce-scatter twice."""
    with model.no_sync():
        loss_of(model, 2 * step).backward()
    loss_of(model, 2 * step + 1).backward()
    model.finish_grad_sync()


@check(SUITE, world_sizes=(2,))
def distributed_optimizer_path_equals_megatron_core_ddp() -> None:
    """megatron-core DDP's distributed-optimizer path (use_distributed_optimizer=True: gradients accumulated
    through no_sync, reduce-scattered into its grad buffer; each rank steps its shard of the parameter buffer;
    start_param_sync all-gathers it), with and without overlap_grad_reduce (its backward hooks then start the
    reduce-scatters), == our adapter with use_distributed_optimizer=True under each sharding strategy (and
    ZeRO-3 with overlapped reduction and gathers) and the same loop calls: every parameter after 4 steps of 2
    micro-batches, bitwise at 2 ranks."""
    args = model_args()
    lr, weight_decay, steps = 1e-2, 0.1, 4
    initial = {n: p.detach().clone() for n, p in build(args).named_parameters()}
    reference = None
    for overlap in (False, True):  # with overlap_grad_reduce the backward hooks start the reduce-scatters
        module = build(args)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap)
        theirs = McoreDDP(config=module.config, ddp_config=ddp_config, module=module)
        opt = _shard_step_optimizer(theirs, lr, weight_decay)
        for step in range(steps):
            theirs.zero_grad_buffer()
            _accumulate_two(theirs, step)
            opt.step()
            theirs.start_param_sync()  # the distributed optimizer's all-gather of the updated shards
        params = {n: p.detach().clone() for n, p in theirs.module.named_parameters()}
        if reference is None:
            reference = params
            assert all(not torch.equal(params[n], initial[n]) for n in params), "every parameter moved (gathered)"
        for name, value in params.items():
            assert_equal(f"megatron-core DDP overlap_grad_reduce={overlap}: {name}", value, reference[name])
    for strategy, overlap in (("optim", False), ("optim_grads", False), ("optim_grads_params", False),
                              ("optim_grads_params", True)):
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=strategy,
                                                   overlap_grad_reduce=overlap, overlap_param_gather=overlap)
        module = build(args)
        mine = FullyShardedDataParallel(module.config, ddp_config, module)
        ours_opt = torch.optim.AdamW(mine.parameters(), lr=lr, weight_decay=weight_decay)
        for step in range(steps):
            mine.zero_grad_buffer()
            ours_opt.zero_grad()
            _accumulate_two(mine, step)
            ours_opt.step()
            mine.start_param_sync()
        for name, param in mine.module.module.named_parameters():
            assert_equal(f"distributed optimizer {strategy} (overlap {overlap}): {name}", param.full_tensor(),
                         reference[name])


def _pretrain(argv: list[str]):
    from megatron.training.training import pretrain
    from pretrain_gpt import forward_step, model_provider

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        run = pretrain(model_provider, forward_step, argv)
    return run, log.getvalue()


@check(SUITE, world_sizes=(2,))
def pretrain_gpt_trains_and_resumes_megatron_core_model() -> None:
    """pretrain_gpt.py builds megatron-core's model by default, trains, and resumes an fsdp_dtensor checkpoint
    bitwise (dropout on: megatron-core's RNG tracker states travel in the checkpoint); with
    --init-model-with-meta-device it trains bitwise as the eager build (fp32, and bf16)."""
    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    common = ["--mock-data", "--vocab-size", "61", "--num-layers", "2", "--hidden-size", "16",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-2",
              "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
              "--ckpt-format", "fsdp_dtensor", "--train-iters", "6"]
    full, log = _pretrain(common)
    assert "building megatron-core GPTModel (local layer spec, CPU compatibility layer)" \
        in log or dist.get_rank() != 0, log[:2000]
    losses = [full.losses[i] for i in sorted(full.losses)]
    assert losses[-1] < losses[0], losses
    _pretrain([*common, "--save", os.path.join(root, "ckpt"), "--save-interval", "3", "--exit-interval", "3"])
    resumed, _ = _pretrain([*common, "--load", os.path.join(root, "ckpt")])
    for it in (4, 5, 6):
        assert resumed.losses[it] == full.losses[it], (it, resumed.losses, full.losses)
    # built on the meta device and materialised by the engine (mcore_meta_init.py): every loss bitwise the eager
    # build's, dropout on (materialisation leaves the CPU generator where megatron-core's constructors left it)
    meta, log = _pretrain([*common, "--init-model-with-meta-device"])
    assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
    assert meta.losses == full.losses, (meta.losses, full.losses)
    bf16 = [*common[:-2], "--train-iters", "3", "--bf16"]  # bf16 weights: megatron-core's casts replayed too
    eager_bf16, meta_bf16 = _pretrain(bf16)[0], _pretrain([*bf16, "--init-model-with-meta-device"])[0]
    assert meta_bf16.losses == eager_bf16.losses, (meta_bf16.losses, eager_bf16.losses)


@check(SUITE, world_sizes=(2,))
def cpu_compat_patches_fit_the_installed_megatron_core() -> None:
    """Every patch's megatron-core line still reads as expected; a changed line or version is reported."""
    from megatron.training import mcore_cpu_compat as compat

    assert compat.stale_patches() == [], compat.stale_patches()
    moved = dataclasses.replace(compat.PATCHES[0], lines=(compat.PATCHES[0].lines[0] + 1,))
    gone = dataclasses.replace(compat.PATCHES[4], target="no_such_function")
    problems = compat.stale_patches((moved, gone))
    assert len(problems) == 2 and "now reads" in problems[0] and "no longer exists" in problems[1], problems
    real = compat.installed_version
    compat.installed_version = lambda: "0.17.0"
    try:
        assert "megatron-core 0.17.0 is installed; these patches are for 0.16.1" in compat.stale_patches()[0]
    finally:
        compat.installed_version = real
    if not torch.cuda.is_available():  # applied (with parallel_state, as a model build does): what megatron-core calls
        initialize_mcore_parallel(model_args(), seed=1)
        from megatron.core.fusions import fused_softmax

        mask = fused_softmax.get_default_causal_mask(3)
        assert mask.device.type == "cpu" and mask.tolist() == [[False, True, True], [False, False, True],
                                                               [False, False, False]]
        seed = 77
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        states = tensor_parallel.get_cuda_rng_tracker().get_states()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        expected = torch.Generator().manual_seed(seed + 2718 + tp_rank).get_state()
        assert torch.equal(states["model-parallel-rng"], expected), "the TP rank's CPU generator state"
        with tensor_parallel.get_cuda_rng_tracker().fork():
            drawn = torch.rand(4)
        assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank)))
        from megatron.core.transformer.moe import token_dispatcher

        stream = token_dispatcher.torch.cuda.Stream()  # the alltoall dispatcher's side stream: a CPU stand-in
        with token_dispatcher.torch.cuda.stream(stream):
            stream.wait_stream(token_dispatcher.torch.cuda.current_stream())
        stream.record_event().synchronize()
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
        assert splits.tolist() == [3, 5] and not torch.is_tensor(splits), "split sizes as a host array"


@check(SUITE, world_sizes=(2,))
def model_choice_names_the_cause() -> None:
    """megatron-core's model, always (auto is the same); where it cannot run, start-up stops naming the flag."""
    from megatron.training.arguments import ArgumentError

    def args_for(*flags: str):
        return validate_args(parse_args(["--mock-data", "--vocab-size", "64", *flags]), dist.get_world_size())

    assert args_for().model_provider == "mcore" and args_for("--model-provider", "auto").model_provider == "mcore"
    assert args_for("--context-parallel-size", "2").model_provider == "mcore", "CP: mcore_cp_attention.py"
    for flags, cause in ((["--num-experts", "2", "--disable-bias-linear"], "pass --no-bias-gelu-fusion"),
                         (["--num-experts", "2", "--swiglu"], "pass --disable-bias-linear")):
        for provider in ([], ["--model-provider", "auto"]):
            try:
                args_for(*flags, *provider)
            except ArgumentError as error:
                assert cause in str(error) and "megatron-core's GPTModel" in str(error), error
            else:
                raise AssertionError(f"{flags} {provider} should stop")
    for flags in (["--num-experts", "2", "--disable-bias-linear", "--no-bias-gelu-fusion"],
                  ["--num-experts", "2", "--swiglu", "--disable-bias-linear"]):
        assert args_for(*flags).model_provider == "mcore", f"megatron-core's MoELayer runs {flags}"
    meta = args_for("--use-megatron-fsdp", "--init-model-with-meta-device")  # mcore_meta_init.py initialises it
    assert meta.model_provider == "mcore", vars(meta)
    for backend in ([], ["--use-megatron-fsdp"], ["--use-torch-fsdp2"]):  # []: plain DDP (CPUAutocastRewrap)
        assert args_for("--bf16", *backend).model_provider == "mcore", f"--bf16 with {backend} runs megatron-core"
    # megatron-core's MoELayer under TP: with --sequence-parallel, experts split over the expert TP group (Megatron's
    # default: the TP size); whole experts (--expert-tensor-parallel-size 1) only under expert parallelism
    moe_tp = ["--num-experts", "2", "--disable-bias-linear", "--no-bias-gelu-fusion", "--tensor-model-parallel-size",
              "2"]
    for flags, cause in (([], "without --sequence-parallel"),
                         (["--sequence-parallel", "--expert-tensor-parallel-size", "1"],
                          "needs --expert-model-parallel-size > 1")):
        try:
            args_for(*moe_tp, *flags)
        except ArgumentError as error:
            assert cause in str(error), error
        else:
            raise AssertionError(f"MoE at TP2 with {flags} should stop")
    tp_moe = args_for(*moe_tp, "--sequence-parallel")
    assert tp_moe.model_provider == "mcore" and tp_moe.sequence_parallel, vars(tp_moe)
    assert tp_moe.expert_tensor_parallel_size == 2 and tp_moe.expert_data_parallel_size == 1, vars(tp_moe)
    config = transformer_config_from_args(model_args("--swiglu", "--normalization", "RMSNorm", "--num-query-groups",
                                                     "2", "--untie-embeddings-and-output-weights"))
    assert config.gated_linear_unit and config.normalization == "RMSNorm" and config.use_cpu_initialization
    assert config.num_query_groups == 4, "Megatron: --num-query-groups counts only with --group-query-attention"
    gqa = transformer_config_from_args(model_args("--group-query-attention", "--num-query-groups", "2"))
    assert gqa.num_query_groups == 2 and gqa.params_dtype == torch.float32


@check(SUITE, world_sizes=(2,))
def pretrain_gpt_tensor_parallel_megatron_core_model() -> None:
    """pretrain_gpt.py with megatron-core's model (RoPE, SwiGLU, RMSNorm) at TP2 trains as at TP1 x DP2.

    megatron-core builds the full weights on the host and gives each TP rank its slice
    (use_cpu_initialization), so both layouts start from the same model; dropout is off, and
    the TP-split matmuls sum in another order: within 1e-5 relative (DESIGN's bar for
    another reduction order).
    """
    # The vocabulary is padded to a multiple of 64 x TP: 128 rows at TP1 and TP2 alike.
    common = ["--mock-data", "--vocab-size", "120", "--make-vocab-size-divisible-by", "64", "--num-layers", "2",
              "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "16", "--global-batch-size", "4",
              "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "4",
              "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
              "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--eval-interval", "2",
              "--eval-iters", "1"]
    data_parallel, _ = _pretrain(common)
    assert data_parallel.valid_losses, "evaluation ran"
    # under --sequence-parallel megatron-core's model too: the front-end's sequence-parallel torch norms
    # (mcore_norm.py), whose gradients the loop sums over TP
    for extra in ([], ["--sequence-parallel"]):
        tensor_parallel_run, log = _pretrain([*common, "--tensor-model-parallel-size", "2", *extra])
        assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:3000]
        for it, loss in data_parallel.losses.items():
            want = torch.tensor(loss)
            torch.testing.assert_close(torch.tensor(tensor_parallel_run.losses[it]), want, rtol=1e-5, atol=0,
                                       msg=lambda m, e=extra, i=it: f"TP2 {e} iteration {i}: {m}")
        for it, norm in data_parallel.grad_norms.items():
            torch.testing.assert_close(torch.tensor(tensor_parallel_run.grad_norms[it]), torch.tensor(norm),
                                       rtol=1e-5, atol=0, msg=lambda m, e=extra, i=it: f"TP2 {e} norm {i}: {m}")


def moe_args(ep: int):
    """megatron-core's MoE GPT: 4 experts, top-2, Megatron's allgather dispatcher, SwiGLU without biases
    (megatron-core's fused weighted SwiGLU has no bias), expert-parallel over ``ep`` ranks."""
    return model_args("--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
                      "--expert-model-parallel-size", str(ep), "--use-megatron-fsdp")


@check(SUITE)
@compiling
def moe_expert_parallel_2_equals_megatron_core_ddp() -> None:
    """megatron-core's MoELayer at EP2 (expert parameters allreduce=False, expert data-parallel groups from
    parallel_state) under our engine == megatron-core DDP at EP2."""

    args = moe_args(ep=2)
    world = dist.get_world_size()
    try:
        model = build(args)
        assert parallel_state.get_expert_model_parallel_world_size() == 2
        assert isinstance(model.decoder.layers[0].mlp, MoELayer)
        experts = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
        assert experts, "megatron-core marks its expert parameters allreduce=False"
        reference = train_mcore_ddp(args)
        expt_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
        for strategy in STRATEGIES:
            module = build(args)
            ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
            wrapped = FullyShardedDataParallel(module.config, ddp_config, module, expt_device_mesh=expt_mesh)
            assert_same(f"EP2 {strategy}", train_wrapped(wrapped), reference)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# --bf16 as Megatron-LM runs megatron-core DDP: bf16 model weights and compute, gradients accumulated and reduced in
# fp32 (DistributedDataParallelConfig(grad_reduce_in_fp32=True): fp32 main_grad buffers), and Megatron's
# Float16OptimizerWithFloat16Params stepping fp32 main copies of the weights, copied back into the bf16 ones.
# Our engine's bf16 (bf16 model weights, preserve_fp32_weights: fp32 main weights the optimizer steps, fp32
# gradient accumulation and reduction with grad_reduce_in_fp32) does the same arithmetic: the same bf16 forward and
# backward from the same bf16 weights, each bf16 gradient widened exactly to fp32, the fp32 reduction (at 2 ranks a
# sum of two terms, one order; the 1/2 scale exact), the same fp32 AdamW on the main weights and the same
# round-to-nearest into bf16. So at 2 ranks the bar is bitwise, on the fp32 main weights and every loss. At 4 ranks
# gloo's ring sums four fp32 terms in a bucket-dependent order (``exact()``); a last-bit difference of an fp32 main
# weight can flip its bf16 rounding, and the run then computes with weights one bf16 ulp (2^-8 relative) apart: the
# functional suite's order-of-sum bar for bf16 runs, 1e-2 relative, on every loss and on each main weight's norm
# of difference.
BF16_RTOL = 1e-2


def build_bf16(args) -> torch.nn.Module:
    """megatron-core's GPTModel in bf16, as Megatron's Float16Module (``module.bfloat16()``) and pretrain_gpt.py's
    engine (backends.py) hold it: megatron-core builds most weights in ``params_dtype`` but not all."""
    module = build(args).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    return module


def train_mcore_ddp_bf16(args) -> tuple[dict, list[float]]:
    """Megatron's bf16 loop over megatron-core DDP (grad_reduce_in_fp32): the fp32 main weights after ``STEPS``
    steps, and each step's loss."""
    module = build_bf16(args)
    model = McoreDDP(config=module.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                     module=module)
    named = list(module.named_parameters())
    mains = [p.detach().float().clone() for _, p in named]  # Float16OptimizerWithFloat16Params' main params
    opt, losses = optimizer(mains), []
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        model.finish_grad_sync()
        for (_, param), main in zip(named, mains):
            assert param.main_grad.dtype == torch.float32
            main.grad = param.main_grad  # _copy_model_grads_to_main_grads
        opt.step()
        with torch.no_grad():
            for (_, param), main in zip(named, mains):
                param.copy_(main)  # _copy_main_params_to_model_params
        losses.append(loss.item())
    return {n: m.detach().clone() for (n, _), m in zip(named, mains)}, losses


def assert_same_bf16(what: str, got: tuple[dict, list[float]], want: tuple[dict, list[float]]) -> None:
    """Bitwise at 2 data-parallel ranks (``exact()``); else losses and each main weight within ``BF16_RTOL``."""
    if exact():
        assert_same(what, got, want)
        return
    params, losses = got
    ref_params, ref_losses = want
    assert params.keys() == ref_params.keys(), f"{what}: {sorted(params)} vs {sorted(ref_params)}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_RTOL, atol=0,
                               msg=lambda m: f"{what}: losses: {m}")
    for name, value in params.items():
        off = (value - ref_params[name]).norm() / ref_params[name].norm().clamp(min=1e-12)
        assert off <= BF16_RTOL, f"{what}: {name} is {off:.3g} of its norm away (bf16 bar {BF16_RTOL})"


@check(SUITE)
def moe_expert_parallel_2_bf16_equals_megatron_core_ddp() -> None:
    """--bf16: megatron-core's MoE GPTModel at EP2 under our four strategies (bf16 weights and compute, fp32 main
    weights, fp32 gradient reduction) == Megatron's bf16 megatron-core DDP (grad_reduce_in_fp32) with fp32 main
    weights: the fp32 main weights and every loss, bitwise at 2 ranks, within ``BF16_RTOL`` at 4."""
    args = model_args("--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
                      "--expert-model-parallel-size", "2", "--use-megatron-fsdp", "--bf16")
    world = dist.get_world_size()
    try:
        reference = train_mcore_ddp_bf16(args)
        assert reference[1][-1] < reference[1][0], f"the loss should fall: {reference[1]}"
        expt_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
        for strategy in STRATEGIES:
            module = build_bf16(args)
            ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                                       grad_reduce_in_fp32=True)
            wrapped = FullyShardedDataParallel(module.config, ddp_config, module, expt_device_mesh=expt_mesh)
            got = train_wrapped(wrapped)
            dtypes = {value.dtype for value in got[0].values()}
            assert dtypes == {torch.float32}, f"EP2 bf16 {strategy}: the parameters the optimizer steps are {dtypes}"
            assert_same_bf16(f"EP2 bf16 {strategy}", got, reference)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


@check(SUITE, world_sizes=(4,))
def moe_tensor_parallel_2_sequence_parallel_expert_parallel_2_equals_megatron_core_ddp() -> None:
    """megatron-core's MoELayer under TP2 + sequence parallelism x DP2, experts EP2 x expert-DP2 (expert TP 1),
    with the front-end's sequence-parallel torch norms (mcore_norm.py): our engine over DP == megatron-core DDP
    with the same layout, Megatron's finalize_model_grads (DP reduction, then the sum over TP of the
    sequence-parallel norms' and router's gradients), several AdamW steps, bitwise (each gradient element a
    sum of two ranks' terms over DP, expert DP and TP alike)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron.training.mcore_norm import SequenceParallelTorchNorm  # noqa: F401 (the spec's norm)
    from megatron_fsdp.parallel import TensorParallel, allreduce_sequence_parallel_grads

    args = model_args("--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
                      "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                      "2", "--expert-tensor-parallel-size", "1", "--use-megatron-fsdp")
    try:
        model = build(args)
        ps = parallel_state
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size(), ps.get_expert_data_parallel_world_size()) == (2, 2, 1, 2)
        assert model.config.sequence_parallel and isinstance(model.decoder.layers[0].mlp, MoELayer)
        norms = [p for n, p in model.named_parameters() if "layernorm" in n]
        assert len(norms) == 2 * 2 * 2 + 2 and all(p.sequence_parallel for p in norms), \
            "every norm (input, pre-MLP, final: weight and bias) is marked for the sum over TP"
        tp_group = parallel_state.get_tensor_model_parallel_group()

        def reference_step(ddp: McoreDDP) -> None:
            finalize_model_grads([ddp])
            main_grads_to_grads(ddp)

        reference = train_mcore_ddp(args, finish=reference_step)
        assert reference[1][-1] < reference[1][0], f"the loss should fall: {reference[1]}"
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        expt_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        assert dist.get_process_group_ranks(expt_mesh.get_group("ep")) == dist.get_process_group_ranks(
            parallel_state.get_expert_model_parallel_group()), "our EP mesh is megatron-core's EP group"
        tp = TensorParallel.from_group(tp_group, sequence_parallel=True)
        for strategy in STRATEGIES:
            module = build(args)
            ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
            wrapped = FullyShardedDataParallel(module.config, ddp_config, module, device_mesh=mesh,
                                               expt_device_mesh=expt_mesh)
            got = train_wrapped(wrapped, after_sync=lambda m: allreduce_sequence_parallel_grads(m.parameters(), tp))
            assert_same(f"MoE TP2+SP EP2 {strategy}", got, reference)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# Expert tensor parallelism (megatron-core's expert_tensor_parallel_size): (TP, expert TP, EP) per world size,
# Megatron's default ETP = TP, under sequence parallelism. At EP1 megatron-core marks experts as dense parameters
# (allreduce=True: the expert TP group must then be the TP group, the front-end refuses others) and our engine
# shards them over the dense mesh; at EP2 over the expert mesh (expert DP 1 at 4 ranks).
EXPERT_TP_LAYOUTS = {2: ((2, 2, 1),), 4: ((2, 2, 2),)}


@check(SUITE)
def moe_expert_tensor_parallel_equals_megatron_core_ddp() -> None:
    """megatron-core's MoELayer with expert tensor parallelism (each expert's fc1/fc2 split over megatron-core's
    expert-TP group: real TP slices, tensor_model_parallel with partition_dim, not over the dense TP group) under
    our engine, experts sharded over the expert mesh (dp_shard, ep, tp) = (expert DP, EP, expert TP) in
    megatron-core's rank order, == megatron-core DDP with the same layout and finalize_model_grads, each of the
    four strategies, several AdamW steps, bitwise (``exact()``)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_fsdp.parallel import TensorParallel, allreduce_sequence_parallel_grads

    world = dist.get_world_size()
    try:
        for tp_size, etp_size, ep_size in EXPERT_TP_LAYOUTS[world]:
            what = f"TP{tp_size} ETP{etp_size} EP{ep_size}"
            sp = ["--sequence-parallel"] if tp_size > 1 else []
            args = model_args("--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
                              "--tensor-model-parallel-size", str(tp_size), *sp, "--expert-model-parallel-size",
                              str(ep_size), "--expert-tensor-parallel-size", str(etp_size), "--use-megatron-fsdp")
            model = build(args)
            ps = parallel_state
            edp = world // (etp_size * ep_size)
            assert (ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
                    ps.get_expert_model_parallel_world_size(), ps.get_expert_data_parallel_world_size()) == (
                        tp_size, etp_size, ep_size, edp), what
            fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
            assert fc1.tensor_model_parallel and fc1.partition_dim == 0 and fc1.allreduce == (ep_size == 1), what
            assert fc1.shape[0] == 2 * 24 // etp_size, f"{what}: each expert's gated fc1 split over expert TP"
            reference = train_mcore_ddp(args, finish=lambda ddp: (finalize_model_grads([ddp]),
                                                                    main_grads_to_grads(ddp)))
            assert reference[1][-1] < reference[1][0], f"{what}: the loss should fall: {reference[1]}"
            mesh = init_device_mesh("cpu", (world // tp_size, tp_size), mesh_dim_names=("dp_shard", "tp"))
            expt_mesh = init_device_mesh("cpu", (edp, ep_size, etp_size), mesh_dim_names=("dp_shard", "ep", "tp"))
            for dim, group in (("tp", ps.get_expert_tensor_parallel_group()),
                               ("ep", ps.get_expert_model_parallel_group()),
                               ("dp_shard", ps.get_expert_data_parallel_group())):
                assert dist.get_process_group_ranks(expt_mesh.get_group(dim)) == dist.get_process_group_ranks(
                    group), f"{what}: our expert mesh's {dim} is megatron-core's group"
            if ep_size == 1:
                expt_mesh = None  # dense parameters to megatron-core, and to us
            tp = TensorParallel.from_group(ps.get_tensor_model_parallel_group(), sequence_parallel=bool(sp))
            for strategy in STRATEGIES:
                module = build(args)
                ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                                           data_parallel_sharding_strategy=strategy)
                wrapped = FullyShardedDataParallel(module.config, ddp_config, module, device_mesh=mesh,
                                                   expt_device_mesh=expt_mesh)
                got = train_wrapped(wrapped,
                                    after_sync=lambda m, tp=tp: allreduce_sequence_parallel_grads(m.parameters(), tp))
                assert_same(f"MoE {what} {strategy}", got, reference)
            destroy_mcore_parallel()
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# pretrain_gpt.py's megatron-core MoE model: the DeepSeek proxy's MoE options at a small size, the aux loss on
# (its backward scale is the loop's job), 2 micro-batches per step (the scale is 1 / 2), dropout off and a
# constant learning rate without clipping (the reference loop below is Megatron's, without a scheduler).
# ZeRO-1 (optim): like megatron-core DDP it accumulates both micro-batches before one reduction (ZeRO-2/3
# reduce each micro-batch's sharded gradients: another summation order, not bitwise).
PRETRAIN_MOE = ["--mock-data", "--vocab-size", "61", "--make-vocab-size-divisible-by", "1", "--num-layers", "3",
                "--hidden-size", "16", "--ffn-hidden-size", "24", "--num-attention-heads", "4", "--seq-length", "12",
                "--micro-batch-size", "2", "--lr", "1e-2", "--lr-decay-style", "constant", "--clip-grad", "0",
                "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--train-iters", "4",
                "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim",
                "--model-provider", "mcore", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
                "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8", "--moe-layer-freq", "([0]*1+[1]*2)",
                "--moe-aux-loss-coeff", "1e-2", "--moe-shared-expert-intermediate-size", "8",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", "1e-2", "--moe-router-pre-softmax", "--moe-grouped-gemm",
                "--expert-model-parallel-size", "2"]


# At 4 data-parallel ranks gradients differ in their last bits (``exact()``), and pretrain's optimizer is AdamW,
# whose m / sqrt(v) scales a last-bit gradient difference by up to the learning rate over |gradient| for
# elements of small gradient: parameters are compared within 1e-4 of the learning rate (1e-2) per element.
ADAM_ATOL = 1e-6


def _pretrain_capturing(argv: list[str]):
    """pretrain() with pretrain_gpt's model provider, keeping the built module and its initial state."""
    from megatron.training.training import pretrain
    from pretrain_gpt import forward_step, model_provider

    built = []

    def provider(*a, **k):
        module = model_provider(*a, **k)
        built.append((module, {k: v.detach().clone() for k, v in module.state_dict().items()
                               if isinstance(v, torch.Tensor)}))
        return module

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        run = pretrain(provider, forward_step, argv)
    (module, initial), = built
    return run, module, initial, log.getvalue()


def _megatron_core_ddp_moe_reference(args, initial: dict) -> tuple[dict, dict, dict]:
    """Megatron-LM's loop over megatron-core DDP on the same model, data and AdamW: params, losses, MoE losses.
    (The expert bias must move at some step: the sign updates of 4 steps may cancel by the end.)"""
    from pretrain_gpt import model_provider

    module = model_provider()
    missing, unexpected = module.load_state_dict(initial, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    get_moe_layer_wise_logging_tracker().clear()
    model = McoreDDP(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    opt = build_adamw(args, module)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train_iter, _, _ = build_train_valid_test_data_iterators(args, dp_rank, dp_size)
    n = args.global_batch_size // (args.micro_batch_size * dp_size)
    assert n == 2, n
    losses, moe_losses, bias_moved = {}, {}, False
    for it in range(1, args.train_iters + 1):
        model.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        totals = torch.zeros(3, dtype=torch.float64)
        for _ in range(n):
            batch = next(train_iter)
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))  # schedules.forward_step
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            masked, tokens = (per_token.float() * batch["loss_mask"]).sum(), batch["loss_mask"].sum()
            (masked / tokens.clamp(min=1) / n).backward()
            masked, tokens = masked.detach().double(), tokens.double()
            totals += torch.stack([masked, tokens, masked / tokens.clamp(min=1.0)])
        model.finish_grad_sync()
        _update_router_expert_bias([module], module.config)  # finalize_model_grads' MoE part
        reset_model_temporary_tensors(module.config, [module])
        biases = [b for n, b in module.named_buffers() if n.endswith("expert_bias")]
        bias_moved = bias_moved or any(b.abs().sum() > 0 for b in biases)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        losses[it] = totals[2].item() / (n * dp_size)
        tracked = {}
        track_moe_metrics(loss_scale=1.0 / n, iteration=it, total_loss_dict=tracked,
                          track_names=sorted(get_moe_layer_wise_logging_tracker()), num_layers=args.num_layers,
                          moe_layer_freq=args.moe_layer_freq)
        moe_losses[it] = {k: float(v) for k, v in tracked.items()}
        for param in module.parameters():
            param.grad = param.main_grad
        opt.step()
    state = {n: p.detach().clone() for n, p in module.named_parameters()}
    state.update({n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")})
    assert bias_moved, "the routers' expert bias should move during training"
    return state, losses, moe_losses


@check(SUITE, params={"dispatcher": ["allgather", "alltoall"]})
def pretrain_gpt_megatron_core_moe_equals_megatron_core_ddp(dispatcher: str) -> None:
    """pretrain_gpt.py with megatron-core's MoE GPT at EP2 (shared experts, sigmoid router with pre-softmax and
    expert bias, grouped GEMM's CPU substitute, a dense first layer), trained by our engine, equals Megatron-LM's
    loop over megatron-core DDP: every iteration's lm loss and load_balancing_loss, every parameter and router
    expert bias after 4 AdamW steps of 2 micro-batches each (bitwise at 2 ranks; at 4, losses within 1e-6 and
    parameters within ``ADAM_ATOL``); saved at 2 and resumed, the run continues bitwise (the expert bias is in
    the checkpoint; the routers' token counts are per step)."""
    world = dist.get_world_size()
    argv = [*PRETRAIN_MOE, "--global-batch-size", str(4 * world), "--moe-token-dispatcher-type", dispatcher]
    try:
        run, module, initial, log = _pretrain_capturing(argv)
        assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
        layers = [type(layer.mlp) for layer in module.decoder.layers]
        assert layers[0] is not MoELayer and layers[1] is MoELayer and layers[2] is MoELayer, layers
        assert module.decoder.layers[1].mlp.shared_experts is not None
        experts = module.decoder.layers[1].mlp.experts
        assert isinstance(experts, SequentialMLP), f"--moe-grouped-gemm on CPU: SequentialMLP, got {type(experts)}"
        args = get_args()
        reference, ref_losses, ref_moe = _megatron_core_ddp_moe_reference(args, initial)
        iterations = sorted(run.losses)
        assert iterations == sorted(ref_losses) == [1, 2, 3, 4], (iterations, sorted(ref_losses))
        assert_equal("lm loss", torch.tensor([run.losses[i] for i in iterations], dtype=torch.float64),
                     torch.tensor([ref_losses[i] for i in iterations], dtype=torch.float64))
        assert ref_losses[4] < ref_losses[1], ref_losses
        assert set(run.moe_losses[1]) == {"load_balancing_loss"} == set(ref_moe[1]), (run.moe_losses, ref_moe)
        balancing = [run.moe_losses[i]["load_balancing_loss"] for i in iterations]
        assert_equal("load_balancing_loss", torch.tensor(balancing),
                     torch.tensor([ref_moe[i]["load_balancing_loss"] for i in iterations]))
        ours_state = {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
        ours_state.update({n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")})
        assert ours_state.keys() == reference.keys(), sorted(set(ours_state) ^ set(reference))
        assert len([n for n in reference if n.endswith("expert_bias")]) == 2, sorted(reference)
        for name, value in ours_state.items():
            if exact():
                assert_equal(name, value, reference[name])
            else:  # measured: up to 1.4e-7 (1.4e-5 of the learning rate), on 1 of 384 elements
                torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=ADAM_ATOL,
                                           msg=lambda m, n=name: f"{n}: {m}")
        if dispatcher == "alltoall":  # the checkpoint holds the routers' expert bias: a resume continues bitwise
            with shared_tmpdir() as root:
                ckpt = ["--ckpt-format", "fsdp_dtensor", "--save", root, "--save-interval", "2"]
                _pretrain_capturing([*argv, *ckpt, "--exit-interval", "2"])
                resumed, _, _, _ = _pretrain_capturing([*argv, *ckpt, "--load", root])
            for it in (3, 4):
                assert resumed.losses[it] == run.losses[it], (it, resumed.losses, run.losses)
                assert resumed.moe_losses[it] == run.moe_losses[it], (it, resumed.moe_losses, run.moe_losses)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# Multi-latent attention at the sizes of a small model: queries through a LoRA (q_lora_rank), query/key head 6 + 2
# (nope + rope), value head 5 (the core attention's query/key and value head sizes all differ from kv_channels 4).
MLA_FLAGS = ("--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "8", "--qk-head-dim", "6",
             "--qk-pos-emb-head-dim", "2", "--v-head-dim", "5", "--rotary-scaling-factor", "1.0", "--mscale", "1.0",
             "--mscale-all-dim", "1.0", "--qk-layernorm", "--normalization", "RMSNorm", "--position-embedding-type",
             "rope")


@check(SUITE, world_sizes=(2,))
def multi_latent_attention_equals_megatron_core_ddp() -> None:
    """megatron-core's MLA GPTModel (the front-end's CPU layer spec) under our engine, and under FSDP2, == megatron-core
    DDP == torch DDP, bitwise at 2 ranks; its core attention == softmax(q k^T * scale) v."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron.training.mcore_mla import MLADotProductAttention

    args = model_args(*MLA_FLAGS)
    model = build(args)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention) and isinstance(attention.core_attention, MLADotProductAttention)
    # The core attention alone: [s, b, heads, d] inputs with query/key head 8 and value head 5, causal.
    core = MLADotProductAttention(model.config, 1, AttnMaskType.causal, "self", attention_dropout=0.0,
                                  softmax_scale=0.3, k_channels=8, v_channels=5)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 2, 4, d, generator=g) for d in (8, 8, 5))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, scale=0.3)
    got = core(q, k, v, None)
    assert got.shape == (7, 2, 20), got.shape
    torch.testing.assert_close(got, want.permute(2, 0, 1, 3).reshape(7, 2, 20), rtol=1e-5, atol=1e-6)
    reference = train_mcore_ddp(args)
    assert reference[1][-1] < reference[1][0], f"the loss should fall: {reference[1]}"
    assert_same("MLA: torch DDP vs megatron-core DDP", train_torch_ddp(args), reference)
    for strategy in ("no_shard", "optim_grads_params"):
        assert_same(f"MLA: {strategy}", train_ours(args, strategy), reference)
    assert_same("MLA: FSDP2", train_torch_fsdp2(args), reference)


def train_torch_fsdp2(args) -> tuple[dict, list[float]]:
    """megatron-core's GPTModel wrapped as --use-torch-fsdp2 wraps it (megatron/training/torch_fsdp2.py)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from megatron.training.torch_fsdp2 import wrap_with_torch_fsdp2

    module = build(args)  # lays out megatron-core's parallel_state
    layout = type("Layout", (), {"grad_group": parallel_state.get_data_parallel_group()})()
    model = wrap_with_torch_fsdp2(module, torch.device("cpu"), layout, bf16=False, grad_reduce_in_bf16=False,
                                  untied=args.untie_embeddings_and_output_weights)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == 2 and all(isinstance(m, TorchFSDPModule) for m in layers), "megatron-core's layers are units"
    assert all(hasattr(p, "tensor_model_parallel") for p in model.decoder.layers[0].mlp.linear_fc1.parameters()), \
        "megatron-core's parameter attributes survive fully_shard"
    losses = train_plain(model)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, losses


@check(SUITE, world_sizes=(2,))
def torch_fsdp2_equals_megatron_core_ddp() -> None:
    """--use-torch-fsdp2's wrapping of megatron-core's GPTModel (tied and untied embeddings) == megatron-core DDP,
    bitwise at 2 ranks; pretrain_gpt.py --use-torch-fsdp2 builds megatron-core's model and trains as DDP does."""
    for flags in ((), ("--untie-embeddings-and-output-weights",)):
        args = model_args(*flags)
        assert_same(f"FSDP2 {flags}", train_torch_fsdp2(args), train_mcore_ddp(args))
    common = ["--mock-data", "--vocab-size", "61", "--num-layers", "2", "--hidden-size", "16",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "4"]
    ddp, _ = _pretrain(common)
    fsdp2, log = _pretrain([*common, "--use-torch-fsdp2"])
    assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
    for it, loss in ddp.losses.items():  # 2 micro-batches per step: accumulation without gradient sync first
        torch.testing.assert_close(torch.tensor(fsdp2.losses[it]), torch.tensor(loss), rtol=1e-6, atol=0,
                                   msg=lambda m, i=it: f"FSDP2 vs DDP iteration {i}: {m}")
    # --bf16: megatron-core builds bf16 weights; FSDP2 shards fp32 copies and computes in bf16, as our engine does
    # (fp32 main weights, bf16 compute): the bf16 tolerance 1e-2 (measured 7e-6).
    ours_bf16, _ = _pretrain([*common, "--bf16", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                              "optim_grads_params"])
    fsdp2_bf16, _ = _pretrain([*common, "--bf16", "--use-torch-fsdp2"])
    for it, loss in ours_bf16.losses.items():
        torch.testing.assert_close(torch.tensor(fsdp2_bf16.losses[it]), torch.tensor(loss), rtol=1e-2, atol=0,
                                   msg=lambda m, i=it: f"FSDP2 bf16 vs ours bf16 iteration {i}: {m}")
    # megatron-core's TP2 layers under FSDP2 (TP2 x DP1) follow the TP1 x DP2 DDP run within 1e-5 (TP-split matmuls
    # sum in another order; the vocabulary is padded to 128 rows at TP1 and TP2 alike).
    tp_common = ["--mock-data", "--vocab-size", "120", "--make-vocab-size-divisible-by", "64", "--num-layers", "2",
                 "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "16", "--global-batch-size", "4",
                 "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "4",
                 "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm"]
    tp1, _ = _pretrain(tp_common)
    tp2, log = _pretrain([*tp_common, "--use-torch-fsdp2", "--tensor-model-parallel-size", "2"])
    assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
    for it in tp1.losses:
        for what, got, want in (("loss", tp2.losses[it], tp1.losses[it]),
                                ("grad norm", tp2.grad_norms[it], tp1.grad_norms[it])):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0,
                                       msg=lambda m, w=what, i=it: f"FSDP2 TP2 vs DDP TP1 {w} at {i}: {m}")


# The MoE part of the DeepSeek proxy (megatron-core's MoELayer through pretrain_gpt.py) is not wired on this branch.
_MOE_FLAGS = ("--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size")


def _without_moe(argv: list[str]) -> list[str]:
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--"):
            skipping = token.startswith("--moe-") or token in _MOE_FLAGS
        if not skipping:
            out.append(token)
    return out


@check(SUITE, world_sizes=(2,))
def deepseek_proxy_builds_multi_latent_attention() -> None:
    """Megatron-LM's DeepSeek-proxy command line, scaled to CPU with its megatron-core-only flags kept (its MoE
    flags left out), builds megatron-core's GPTModel with multi-latent attention through pretrain_gpt.py, and trains."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    import pretrain_gpt
    from megatron.training.training import pretrain
    from tests.functional.megatron_lm_configs import cpu_scaled

    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    argv = _without_moe(cpu_scaled("deepseek_proxy_fsdp_ep2_fsdp2", os.path.join(holder[0], "ds")))
    assert "--multi-latent-attention" in argv and "--q-lora-rank" in argv and "--num-experts" not in argv, argv
    built = []

    def provider(pre_process: bool = True, post_process: bool = True):
        built.append(pretrain_gpt.model_provider(pre_process, post_process))
        return built[-1]

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        run = pretrain(provider, pretrain_gpt.forward_step, argv)
    model = built[0]
    assert type(model).__module__ == "megatron.core.models.gpt.gpt_model", type(model)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention), type(attention)
    config = model.config
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim, config.rope_type) == (16, 8, 8, 4, 8, "yarn"), config
    assert attention.linear_q_up_proj.weight.shape[0] == 4 * (8 + 4), "query heads: qk_head_dim + qk_pos_emb_head_dim"
    losses = [run.losses[i] for i in sorted(run.losses)]
    assert len(losses) == 16 and losses[-1] < losses[0] - 0.3, losses


# fsdp_dtensor checkpoints of megatron-core's GPTModel: a dense model whose TP-sharded weights include both fused
# layouts (grouped-query QKV, [Q_g | K_g | V_g] per query group; SwiGLU fc1 with bias, [gate_t | up_t] per TP rank,
# megatron-core's partition_stride 2) and an untied output layer; the vocabulary padded to 64 x TP = 128 rows at
# TP1 and TP2 alike. The MoE model: 4 SwiGLU experts (local_experts.N under EP), shared experts, expert bias.
CKPT_DENSE = ["--mock-data", "--vocab-size", "120", "--make-vocab-size-divisible-by", "64", "--num-layers", "2",
              "--hidden-size", "16", "--ffn-hidden-size", "24", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--untie-embeddings-and-output-weights",
              "--seq-length", "12", "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "4",
              "--eval-iters", "0", "--model-provider", "mcore", "--use-megatron-fsdp",
              "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]
CKPT_MOE = [*CKPT_DENSE, "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "8", "--moe-aux-loss-coeff", "1e-2", "--moe-shared-expert-intermediate-size", "8",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
# Another TP or EP size computes the same model with TP-split matmuls / other expert groupings, which round
# differently: DESIGN's bar for another reduction order. The same layout resumes bitwise.
CONVERTED_RTOL = 1e-5


def _full_form(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (and router expert bias) of megatron-core's model as the TP1, EP1 model holds it.

    Written from megatron-core's own conventions, not the checkpoint code's: a TP-sharded
    parameter is all-gathered over megatron-core's TP group and reassembled by its
    ``partition_stride`` (``_initialize_affine_weight_cpu`` gives rank t pieces t, t + T, ...
    of the full tensor cut in stride x T pieces; an expert's over the expert TP group); an expert's parameters take
    the global index
    of megatron-core's ``MoELayer.local_expert_indices`` and are all-gathered over the EP group.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in module.named_parameters():
        value = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        # an expert parameter (allreduce=False: under EP) is split over megatron-core's expert TP group
        expert = not getattr(param, "allreduce", True)
        tp_group = (parallel_state.get_expert_tensor_parallel_group() if expert
                    else parallel_state.get_tensor_model_parallel_group())
        tp = dist.get_world_size(tp_group)
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            dim, stride = param.partition_dim, param.partition_stride
            value = torch.cat([part.chunk(stride, dim)[s] for s in range(stride) for part in parts], dim)
        out[name] = value
    out.update({n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")})
    experts = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, MoELayer):
            for local, global_index in enumerate(sub.local_expert_indices):
                old = f"{prefix}.experts.local_experts.{local}."
                for name in [n for n in out if n.startswith(old)]:
                    experts[f"{prefix}.experts.local_experts.{global_index}.{name[len(old):]}"] = out.pop(name)
    if experts and parallel_state.get_expert_model_parallel_world_size() > 1:
        gathered = [None] * parallel_state.get_expert_model_parallel_world_size()
        dist.all_gather_object(gathered, experts, group=parallel_state.get_expert_model_parallel_group())
        experts = {k: v for part in gathered for k, v in part.items()}
    out.update(experts)
    return out


@contextlib.contextmanager
def _at_save_and_load(capture):
    """``capture(module, optimizer)`` right after each ``--save`` (by iteration) and each ``--load`` (in order)."""
    from megatron.training import checkpointing

    saved, loaded = {}, []
    save, load = checkpointing.save, checkpointing.load

    def saving(args, state, module, optimizer, *rest):
        save(args, state, module, optimizer, *rest)
        saved[state.iteration] = capture(module, optimizer)

    def loading(args, module, optimizer, *rest):
        state = load(args, module, optimizer, *rest)
        loaded.append(capture(module, optimizer))
        return state

    checkpointing.save, checkpointing.load = saving, loading
    try:
        yield saved, loaded
    finally:
        checkpointing.save, checkpointing.load = save, load


def _full_form_at_save_and_load():
    """The model's full form right after each ``--save`` (by iteration) and each ``--load`` (in order)."""
    return _at_save_and_load(lambda module, _optimizer: _full_form(module))


def _assert_same_full_form(what: str, got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, value in got.items():
        diff = (value - want[name]).abs().max().item() if value.shape == want[name].shape else value.shape
        assert value.shape == want[name].shape and torch.equal(value, want[name]), f"{what}: {name} differs: {diff}"


@check(SUITE)
def megatron_core_checkpoints_resume_and_convert() -> None:
    """fsdp_dtensor checkpoints of megatron-core's GPTModel through pretrain_gpt.py, saved at 2 of 4 iterations:
    resumed at the same layout (TP2, and MoE at EP2; dropout on, Megatron's default flags) the run continues
    bitwise, with --async-save too (the same training, checkpoint and resumed losses as a synchronous save);
    resumed at another TP, EP, expert TP and data-parallel size (dropout off), the loaded parameters equal the
    saved ones gathered to full form bitwise and the losses and grad norms continue the saved run's within
    ``CONVERTED_RTOL``."""
    world = dist.get_world_size()
    other_ep = 1 if world == 2 else 4  # EP2 x EDP1 -> EP1 x EDP2 at 2 ranks; EP2 x EDP2 -> EP4 x EDP1 at 4
    # (model flags, saved layout, [(resumed layout, bitwise?)]): TP2 x DP(world/2) -> TP1 x DP(world)
    cases = [
        ([*CKPT_DENSE], ["--tensor-model-parallel-size", "2"], [(["--tensor-model-parallel-size", "2"], True)]),
        # the same run with --async-save: a background write of the state copied at the save (compared below)
        ([*CKPT_DENSE, "--async-save"], ["--tensor-model-parallel-size", "2"],
         [(["--tensor-model-parallel-size", "2"], True)]),
        ([*CKPT_DENSE, *NO_DROPOUT], ["--tensor-model-parallel-size", "2"], [([], False)]),
        ([*CKPT_MOE], ["--expert-model-parallel-size", "2"],
         [(["--expert-model-parallel-size", "2"], True), (["--expert-model-parallel-size", str(other_ep)], False)]),
    ]
    if world == 4:  # expert tensor parallelism, Megatron's default ETP = TP 2 with EP2 -> whole experts (ETP1) and
        # back (at 2 ranks ETP2 needs EP1, where megatron-core's experts are dense TP slices: the dense case's path;
        # the same-layout resume of ETP2 is the functional mlm_experts_resume's, bitwise). Back: from the MoE case
        # above, whose dropout masks differ at TP2 (None: the loaded parameters are compared, not the losses).
        etp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
        cases[-1][2].append((etp2, None))
        cases.append(([*CKPT_MOE, *NO_DROPOUT], etp2, [(["--expert-model-parallel-size", "2"], False)]))
    runs = []  # (reference losses, full form saved at 2, resumed losses) of each case's first resume
    try:
        for flags, saved_layout, resumes in cases:
            with shared_tmpdir() as root, _full_form_at_save_and_load() as (saved, loaded):
                ckpt = ["--global-batch-size", str(2 * world), "--save", root, "--save-interval", "2"]
                reference, log = _pretrain([*flags, *saved_layout, *ckpt])
                assert sorted(reference.losses) == [1, 2, 3, 4] and sorted(saved) == [2, 4], (reference, saved)
                if "--async-save" in flags and dist.get_rank() == 0:
                    assert "scheduled an asynchronous save of iteration       2" in log, log[-3000:]
                    assert "successfully saved checkpoint from iteration       4" in log, log[-3000:]
                for layout, bitwise in resumes:
                    what = f"{' '.join(saved_layout)} -> {' '.join(layout) or 'TP1'} ({len(flags)} flags)"
                    resumed, _ = _pretrain([*flags, *layout, "--global-batch-size", str(2 * world),
                                            "--load", os.path.join(root, "iter_0000002")])
                    assert sorted(resumed.losses) == [3, 4], (what, resumed.losses)
                    _assert_same_full_form(f"{what}: loaded vs saved", loaded.pop(), saved[2])
                    if layout == resumes[0][0]:
                        runs.append((reference.losses, saved[2], resumed.losses))
                    for it in (3, 4) if bitwise is not None else ():
                        if bitwise:
                            assert resumed.losses[it] == reference.losses[it], (what, it, resumed.losses,
                                                                                 reference.losses)
                        else:  # the grad norm too: each parameter counted once whatever its TP / EP / ETP split
                            for key, got, want in (("loss", resumed.losses, reference.losses),
                                                   ("grad norm", resumed.grad_norms, reference.grad_norms)):
                                torch.testing.assert_close(
                                    torch.tensor(got[it]), torch.tensor(want[it]), rtol=CONVERTED_RTOL, atol=0,
                                    msg=lambda m, w=what, i=it, k=key: f"{w} {k} at iteration {i}: {m}")
        (sync_losses, sync_saved, sync_resumed), (async_losses, async_saved, async_resumed) = runs[:2]
        assert async_losses == sync_losses, ("--async-save changed training", async_losses, sync_losses)
        _assert_same_full_form("--async-save's checkpoint vs the synchronous one", async_saved, sync_saved)
        assert async_resumed == sync_resumed, ("resumed from --async-save's checkpoint", async_resumed, sync_resumed)
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# A pure data-parallel resize at the same TP, across the two spawned groups of test_mcore_model.py: the 2-rank group
# saves megatron-core's GPTModel at TP2 x DP1 into the directory this variable names (with the run's losses and the
# full form of its parameters and optimizer state at the save), the 4-rank group (started after it) resumes it at
# TP2 x DP2. The same global batch of 8 (4 micro-batches on one DP rank, 2 on each of two): the resumed losses
# continue the saved run's within ``CONVERTED_RTOL`` (the functional suite's 1e-5 for fp32 resumes at another world
# size: the micro-batch and DP sums round in another order); the loaded state is the saved one, bitwise.
HANDOFF_ENV = "MEGATRON_FSDP_MCORE_HANDOFF"
DP_RESIZE = [*CKPT_DENSE, *NO_DROPOUT, "--tensor-model-parallel-size", "2", "--global-batch-size", "8"]


def _handoff_dir() -> str:
    root = os.environ.get(HANDOFF_ENV)
    assert root and os.path.isdir(root), (
        f"${HANDOFF_ENV} must name a directory shared by the 2- and 4-rank groups (test_mcore_model.py sets it)")
    return os.path.join(root, "tp2_dp1")


def _optimizer_full_form(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of ``module``'s parameters (``<parameter>.<key>``) in the form the TP1, DP1 model
    would hold it: a DTensor gathered over data parallelism, a TP-sharded parameter's state reassembled over
    megatron-core's TP group by its ``partition_dim`` and ``partition_stride`` (as ``_full_form`` does)."""
    from torch.distributed.tensor import DTensor

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in module.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            value = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            if value.dim() > 0 and tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(parts, value.contiguous(), group=tp_group)
                dim, stride = param.partition_dim, param.partition_stride
                value = torch.cat([part.chunk(stride, dim)[s] for s in range(stride) for part in parts], dim)
            out[f"{name}.{key}"] = value
    return out


def _model_and_optimizer_at_save_and_load():
    """(parameters' full form, optimizer state's full form) right after each ``--save`` (by iteration) and each
    ``--load`` (in order)."""
    return _at_save_and_load(lambda module, optimizer: (_full_form(module), _optimizer_full_form(module, optimizer)))


@check(SUITE, world_sizes=(2,))
def megatron_core_checkpoint_saved_for_a_data_parallel_resize() -> None:
    """The TP2 x DP1 half of the data-parallel resize (``HANDOFF_ENV``): megatron-core's GPTModel trained 4 iterations
    by pretrain_gpt.py, fsdp_dtensor checkpoint at 2; its losses and full-form state at 2 left for the 4-rank group."""
    root = _handoff_dir()
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    try:
        with _model_and_optimizer_at_save_and_load() as (saved, _):
            run, _ = _pretrain([*DP_RESIZE, "--save", root, "--save-interval", "2"])
        assert sorted(run.losses) == [1, 2, 3, 4] and sorted(saved) == [2, 4], (run.losses, sorted(saved))
        params, optim = saved[2]
        assert any(k.endswith(".exp_avg_sq") for k in optim), sorted(optim)
        if dist.get_rank() == 0:
            torch.save({"losses": run.losses, "params": params, "optimizer": optim}, os.path.join(root, "saved.pt"))
    finally:
        dist.barrier()
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


@check(SUITE, world_sizes=(4,))
def megatron_core_checkpoint_resumes_at_twice_the_data_parallel_size() -> None:
    """The 2-rank group's TP2 x DP1 fsdp_dtensor checkpoint of megatron-core's GPTModel resumed at TP2 x DP2: the loaded
    parameters and optimizer state (full form, megatron-core's TP conventions) equal the saved ones bitwise, and
    iterations 3-4 continue the saved run's losses within ``CONVERTED_RTOL``."""
    root = _handoff_dir()
    saved_file = os.path.join(root, "saved.pt")
    assert os.path.exists(saved_file), f"{saved_file}: the 2-rank group's save is missing (it runs first)"
    reference = torch.load(saved_file, weights_only=True)
    try:
        with _model_and_optimizer_at_save_and_load() as (_, loaded):
            resumed, _ = _pretrain([*DP_RESIZE, "--load", os.path.join(root, "iter_0000002")])
        assert parallel_state.get_data_parallel_world_size() == 2, "TP2 x DP2 at 4 ranks"
        (params, optim), = loaded
        _assert_same_full_form("TP2 x DP1 -> TP2 x DP2: loaded vs saved parameters", params, reference["params"])
        _assert_same_full_form("TP2 x DP1 -> TP2 x DP2: loaded vs saved optimizer state", optim, reference["optimizer"])
        assert sorted(resumed.losses) == [3, 4], resumed.losses
        for it in (3, 4):
            torch.testing.assert_close(torch.tensor(resumed.losses[it]), torch.tensor(reference["losses"][it]),
                                       rtol=CONVERTED_RTOL, atol=0, msg=lambda m, i=it: f"iteration {i}: {m}")
    finally:
        destroy_mcore_parallel()
        initialize_mcore_parallel(model_args(), seed=1)


# --init-model-with-meta-device (megatron/training/mcore_meta_init.py): megatron-core's GPTModel built on the meta
# device, sharded by our engine, each shard materialised by megatron-core's own initialisation replayed module by
# module. Bitwise equal to the eager build (same seed, same machine): the initial full weights, then every loss and
# parameter after the same steps. Layouts per world size: (what, flags, TP mesh, EP mesh). MoE layers cover the
# router, the experts (is_expert layers over the expert TP group) and the shared experts; MLA multi-latent attention
# (whose eager build draws a discarded linear_proj first); TP2 the column/row/vocab-parallel slices.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
META_LAYOUTS = {
    2: (("dense, tied embeddings", [], False, False),
        ("untied, RoPE, SwiGLU, RMSNorm, QK norm",
         ["--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--swiglu", "--normalization",
          "RMSNorm", "--qk-layernorm"], False, False),
        ("MoE EP2, shared experts, expert bias", [*MOE, "--expert-model-parallel-size", "2",
                                                 "--moe-shared-expert-intermediate-size", "16",
                                                 "--moe-router-enable-expert-bias", "--moe-router-score-function",
                                                 "sigmoid"], False, True),
        ("MLA", ["--multi-latent-attention", "--q-lora-rank", "8", "--kv-lora-rank", "8", "--qk-head-dim", "4",
                 "--qk-pos-emb-head-dim", "4", "--v-head-dim", "4"], False, False)),
    4: (("TP2, tied embeddings", ["--tensor-model-parallel-size", "2"], True, False),
        ("TP2 + SP, untied, MoE EP2", [*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                       "--untie-embeddings-and-output-weights"], True, True)),
}


def build_on_meta(args):
    """megatron-core's GPTModel as ``build`` makes it, under ``torch.device("meta")`` (pretrain's
    --init-model-with-meta-device): no storage, each module given its initialiser (mcore_meta_init.py)."""
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        return mcore_gpt_model(args)


@check(SUITE)
def meta_device_build_equals_the_eager_build_bitwise() -> None:
    """megatron-core's GPTModel built on the meta device and materialised by our engine == the eager build: initial
    weights, then every loss and parameter after AdamW steps, bitwise, in each layout of ``META_LAYOUTS``; a module
    whose initialisation the front-end does not replay stops the build naming it and the flag."""
    from megatron.training.errors import UsageError
    from megatron.training.mcore_meta_init import bind_initializers
    from megatron_fsdp.parallel import TensorParallel, allreduce_sequence_parallel_grads

    world = dist.get_world_size()
    for what, flags, tp_mesh, ep_mesh in META_LAYOUTS[world]:
        args = model_args(*flags, "--use-megatron-fsdp", "--init-model-with-meta-device")
        try:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp")) if tp_mesh else None
            expt_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep")) if ep_mesh else None
            arms, after_sync = {}, None
            for arm, builder in (("eager", build), ("meta", build_on_meta)):
                module = builder(args)  # megatron-core's parallel_state laid out for args from here
                if args.sequence_parallel:  # the loop's sum over TP of the sequence-parallel gradients
                    tp = TensorParallel.from_group(parallel_state.get_tensor_model_parallel_group(),
                                                   sequence_parallel=True)
                    after_sync = functools.partial(_sum_sequence_parallel_grads, tp=tp,
                                                   reduce=allreduce_sequence_parallel_grads)
                assert all(p.is_meta for p in module.parameters()) == (arm == "meta"), f"{what}: {arm} build"
                ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                                           data_parallel_sharding_strategy="optim_grads_params")
                wrapped = FullyShardedDataParallel(module.config, ddp_config, module, device_mesh=mesh,
                                                   expt_device_mesh=expt_mesh)
                initial = _full_form(wrapped.module.module)
                arms[arm] = initial, train_wrapped(wrapped, after_sync)
            _assert_same_full_form(f"{what}: initial weights, meta vs eager", arms["meta"][0], arms["eager"][0])
            (params, losses), (ref_params, ref_losses) = arms["meta"][1], arms["eager"][1]
            assert losses == ref_losses, f"{what}: losses {losses} vs eager {ref_losses}"
            _assert_same_full_form(f"{what}: after {STEPS} steps", params, ref_params)
        finally:
            destroy_mcore_parallel()
            initialize_mcore_parallel(model_args(), seed=1)
    if world == 2:  # what the front-end cannot initialise stops the build, naming the module and the flag
        model = build_on_meta(model_args())
        model.decoder.extra = torch.nn.Linear(2, 2, device="meta")
        expect = ("--init-model-with-meta-device", "Linear", "decoder.extra")
        _expect_usage_error(UsageError, expect, bind_initializers, model)
        del model.decoder.extra
        mlp = model.decoder.layers[0].mlp
        mlp.gate_weight = torch.nn.Parameter(torch.empty(1, 16, device="meta"))  # as the shared experts' gate
        _expect_usage_error(UsageError, ("decoder.layers.0.mlp", "beside its children's"), bind_initializers, model)
        del mlp.gate_weight
        model.config.use_cpu_initialization = False  # megatron-core's GPU initialisation (CUDA without the flag)
        _expect_usage_error(UsageError, ("needs --use-cpu-initialization",), bind_initializers, model)


def _sum_sequence_parallel_grads(model, tp, reduce) -> None:
    reduce(model.parameters(), tp)


def _expect_usage_error(exc: type[Exception], fragments: tuple[str, ...], fn, *args) -> None:
    try:
        fn(*args)
    except exc as error:
        assert all(part in str(error) for part in fragments), (fragments, str(error))
    else:
        raise AssertionError(f"{fn.__name__}: no {exc.__name__} raised (expected one naming {fragments})")

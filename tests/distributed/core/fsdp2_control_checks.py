"""FSDP2's ``FSDPModule`` controls on ``megatron_fsdp.fully_shard``, each compared with a replicated reference.

Scenarios follow PyTorch's FSDP2 tests (test/distributed/_composable/fsdp/:
``test_fully_shard_training.py``'s gradient accumulation, 1F1B micro-batching and
custom forward methods, ``test_fully_shard_comm.py``'s explicit prefetching). The
reference holds the same weights unsharded, computes on this rank's batch, and
averages its gradients over the ranks, as the originals do.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from megatron_fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check

SUITE = "fsdp2_controls"
DIM = 16


class MLP(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim + 1)
        self.out_proj = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.relu(self.in_proj(x)))


def make_model(mlps: int = 3) -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(nn.Linear(DIM, DIM), *[MLP() for _ in range(mlps)])


def shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for mlp in model[1:]:
        fully_shard(mlp, **kwargs)
    return fully_shard(model, **kwargs)


def average_grads(reference: nn.Module) -> None:
    for param in reference.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def assert_parity(model: nn.Module, reference: nn.Module, what: str, *, grads: bool = True) -> None:
    """Every sharded parameter (and gradient) of ``model`` equals ``reference``'s.

    At FSDP2's tolerance (its ``check_sharded_parity`` uses ``assertEqual``: fp32 rtol
    1.3e-6, atol 1e-5): gradients of ``.sum()`` losses reach tens, and summing them over
    micro-batches and ranks in another order moves small entries by a few 1e-6.
    """
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=lambda m, n=name: f"{what}: {n}: {m}")
        if grads:
            assert (p.grad is None) == (q.grad is None), f"{what}: {name} grad presence"
            if q.grad is not None:
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda m, n=name: f"{what}: {n}.grad: {m}")


def local_input(step: int, rows: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(rows, DIM, generator=g)


def gathers(model: FSDPModule) -> int:
    return model.fsdp_comm_stats.calls["all_gather"]


def set_backward_flags(model: nn.Sequential, mode: str, reshard_after_backward: bool, is_last: bool) -> None:
    """FSDP2's test: sync (and, unless ``reshard_after_backward``, resharding) only on the last micro-batch."""
    if mode == "all":
        targets, recurse = [model], True
    elif mode == "some_mlps":
        targets, recurse = list(model[1:3]), True
    else:  # root_only
        targets, recurse = [model], False
    for module in targets:
        module.set_requires_gradient_sync(is_last, recurse=recurse)
        if not reshard_after_backward:
            module.set_reshard_after_backward(is_last, recurse=recurse)


@check(SUITE, world_sizes=(2,))
def gradient_accumulation_with_fsdp2_flags() -> None:
    """FSDP2's test_gradient_accumulation: sync off for N-1 micro-batches (all, root only, some MLPs), then on."""
    cases = [(raf, mode, rab) for raf in (True, False) for mode in ("all", "root_only", "some_mlps")
             for rab in (False, True) if rab or (raf is False and mode != "some_mlps")]
    microbatches = 3
    for reshard_after_forward, mode, reshard_after_backward in cases:
        what = f"raf={reshard_after_forward} mode={mode} rab={reshard_after_backward}"
        model = make_model()
        reference = copy.deepcopy(model)
        shard(model, reshard_after_forward=reshard_after_forward)
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]

        per_step = []
        for step in range(3):
            model.fsdp_comm_stats.reset()
            for mb in range(microbatches):
                set_backward_flags(model, mode, reshard_after_backward, mb == microbatches - 1)
                x = local_input(10 * step + mb)
                losses = [m(x).sum() for m in (reference, model)]
                for loss in losses:
                    loss.backward()
                torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5, msg=f"{what} step {step}")
            per_step.append(gathers(model))
            average_grads(reference)
            assert_parity(model, reference, f"{what} step {step}")
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 1)
        if mode == "all" and not reshard_after_forward and not reshard_after_backward:
            # weights kept across the micro-batches: gathered in the first forward only (4 units)
            assert per_step[1:] == [4, 4], f"{what}: all-gathers per step {per_step}"
        if mode == "all" and not reshard_after_forward and reshard_after_backward:
            assert per_step[1:] == [12, 12], f"{what}: all-gathers per step {per_step}"


class Branchy(nn.Module):
    """Block 1 runs only when asked: on some ranks and micro-batches only (data-dependent execution)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([MLP() for _ in range(3)])

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if not (i == 1 and skip):
                x = block(x)
        return x


@check(SUITE, world_sizes=(2, 4))
def reshard_after_backward_false_with_units_that_run_on_some_ranks() -> None:
    """Kept weights are agreed across ranks: a unit skipped on some ranks never mispairs an all-gather."""
    for skip_mb in (0, 1, 2):
        model = Branchy()
        reference = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
        for step in range(2):
            for mb in range(3):
                is_last = mb == 2
                model.set_requires_gradient_sync(is_last)
                model.set_is_last_backward(is_last)
                model.set_reshard_after_backward(is_last)
                skip = dist.get_rank() == 1 and mb == skip_mb
                x = local_input(10 * step + mb)
                losses = [m(x, skip).sum() for m in (reference, model)]
                for loss in losses:
                    loss.backward()
                torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
            for param in reference.parameters():  # a rank that skipped block 1 contributes zeros
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            average_grads(reference)
            assert_parity(model, reference, f"block 1 skipped on rank 1 in micro-batch {skip_mb}, step {step}")
            for opt in opts:
                opt.step()
                opt.zero_grad()


@check(SUITE, world_sizes=(2,))
def one_f_one_b_with_explicit_unshard_and_is_last_backward() -> None:
    """FSDP2's test_1f1b_microbatching: unshard(async_op=True) up front, set_is_last_backward per micro-batch."""
    for use_explicit_unshard in (False, True):
        for reshard_after_backward in (False, True):
            what = f"explicit_unshard={use_explicit_unshard} rab={reshard_after_backward}"
            model = make_model()
            reference = copy.deepcopy(model)
            shard(model, reshard_after_forward=False)
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
            for step in range(2):
                model.fsdp_comm_stats.reset()
                handles = []
                if use_explicit_unshard:
                    handles = [m.unshard(async_op=True) for m in model.modules() if isinstance(m, FSDPModule)]
                    assert all(h is not None and hasattr(h, "wait") for h in handles)
                explicit = gathers(model)
                for mb in range(3):
                    is_last = mb == 2
                    model.set_requires_gradient_sync(is_last)
                    model.set_is_last_backward(is_last)
                    if not reshard_after_backward:
                        model.set_reshard_after_backward(is_last)
                    x = local_input(10 * step + mb)
                    losses = [m(x).sum() for m in (reference, model)]
                    for loss in losses:
                        loss.backward()
                    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5, msg=what)
                in_step = gathers(model) - explicit
                if use_explicit_unshard:
                    assert explicit == 4, f"{what}: the explicit unshards gather each unit once ({explicit})"
                if use_explicit_unshard and not reshard_after_backward:
                    assert in_step == 0, f"{what}: the forwards must use the explicitly gathered weights ({in_step})"
                elif not reshard_after_backward:
                    assert in_step == 4, f"{what}: weights kept between micro-batches ({in_step} gathers)"
                else:
                    expected = 4 * 3 - (4 if use_explicit_unshard else 0)
                    assert in_step == expected, f"{what}: {in_step} gathers, expected {expected}"
                average_grads(reference)
                assert_parity(model, reference, f"{what} step {step}")
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            assert_parity(model, reference, f"{what} after the last step", grads=False)


@check(SUITE, world_sizes=(2,))
def unshard_async_inside_forward_is_issued_in_the_agreed_order() -> None:
    """A hook that unshards the next block (FSDP2's manual prefetch) gives the same numbers and no extra gather."""
    results = {}
    for manual in (False, True):
        model = make_model(4)
        shard(model)
        model.set_prefetch_depth(0)
        if manual:
            for current, following in zip(model[1:4], model[2:5]):
                current.register_forward_pre_hook(lambda m, a, nxt=following: nxt.unshard(async_op=True) and None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            model.fsdp_comm_stats.reset()
            loss = model(local_input(step)).sum()
            loss.backward()
            losses.append(loss.detach())
            calls = gathers(model)
            opt.step()
            opt.zero_grad()
        results[manual] = (losses, [p.full_tensor() for p in model.parameters()], calls)
    assert results[True][2] == results[False][2], f"all-gathers: {results[True][2]} vs {results[False][2]}"
    for a, b in zip(results[True][0] + results[True][1], results[False][0] + results[False][1]):
        assert torch.equal(a, b), "a manual unshard must not change the numbers"


def _prefetch_run(configure, observe: bool) -> tuple[list[torch.Tensor], dict[str, bool]]:
    model = make_model(4)
    shard(model)
    model.set_prefetch_depth(0)
    configure(model)
    seen: dict[str, bool] = {}

    def issued(unit_module: nn.Module) -> bool:
        return all(g._gather is not None or g.state.value == "unsharded" for g in unit_module.fsdp_unit.groups)

    def note(phase: str, unit_module: nn.Module) -> None:  # a hook: returns None, changes nothing
        seen.setdefault(phase, issued(unit_module))

    if observe:
        model[1].register_forward_hook(lambda m, a, o: note("forward", model[3]))
        model[3].register_full_backward_pre_hook(lambda m, g: note("backward", model[1]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        loss = model(local_input(step, rows=3).requires_grad_()).sum()
        loss.backward()
        out.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return out + [p.full_tensor() for p in model.parameters()], seen


@check(SUITE, world_sizes=(2,))
def explicit_prefetch_lists_gather_early_with_identical_numbers() -> None:
    """set_modules_to_forward/backward_prefetch: the listed gathers are issued early; the numbers do not change."""
    baseline, seen_off = _prefetch_run(lambda m: None, observe=True)
    assert seen_off == {"forward": False, "backward": False}, f"depth 0 must not prefetch: {seen_off}"

    def lists(model: nn.Sequential) -> None:
        model[1].set_modules_to_forward_prefetch([model[3]])  # skips model[2]: issued too, in the agreed order
        model[4].set_modules_to_backward_prefetch([model[2], model[1]])

    values, seen = _prefetch_run(lists, observe=True)
    assert seen == {"forward": True, "backward": True}, f"explicit lists must gather early: {seen}"
    for a, b in zip(values, baseline):
        assert torch.equal(a, b), "explicit prefetch must give the same numbers as none"

    def rank_dependent(model: nn.Sequential) -> None:  # lists differ across ranks: order still agreed
        if dist.get_rank() == 0:
            model[1].set_modules_to_forward_prefetch([model[4], model[3]])
            model[3].set_modules_to_backward_prefetch([model[1]])

    values, _ = _prefetch_run(rank_dependent, observe=False)
    for a, b in zip(values, baseline):
        assert torch.equal(a, b), "prefetch lists that differ across ranks must give the same numbers"
    model = make_model(1)
    fully_shard(model)
    expect_error(ValueError, "fully_shard", model.set_modules_to_forward_prefetch, [nn.Linear(2, 2)])


@check(SUITE, world_sizes=(2,))
def gradient_divide_factor_is_gradient_scaling() -> None:
    """set_gradient_divide_factor(f): gradients are the sum over ranks divided by f (also the deprecated name)."""
    factor = 3.0
    for setter in ("set_gradient_divide_factor", "set_reduce_scatter_divide_factor"):
        model = make_model()
        reference = copy.deepcopy(model)
        shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    getattr(module, setter)(factor)  # not recursive, as in FSDP2
                    module.set_force_sum_reduction_for_comms(True)
        if setter == "set_reduce_scatter_divide_factor":
            assert any(issubclass(w.category, FutureWarning) for w in caught), "the old name must warn"
        for step in range(2):
            x = local_input(step)
            for m in (model, reference):
                m(x).sum().backward()
            for param in reference.parameters():
                dist.all_reduce(param.grad)
                param.grad /= factor
            assert_parity(model, reference, f"{setter} step {step}")
            for m in (model, reference):
                m.zero_grad()
    expect_error(ValueError, "positive", model.set_gradient_divide_factor, 0)


@check(SUITE, world_sizes=(4,))
def hsdp_requires_all_reduce_false_reduces_the_accumulated_partials_once() -> None:
    """FSDP2's reduce_scatter_only mode: reduce-scatter every micro-batch, all-reduce across replicas on the last."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    model = make_model()
    reference = copy.deepcopy(model)
    shard(model, mesh=mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(2):
        model.fsdp_comm_stats.reset()
        for mb in range(3):
            is_last = mb == 2
            model.set_requires_all_reduce(is_last)
            x = local_input(10 * step + mb)
            for m in (model, reference):
                m(x).sum().backward()
            if not is_last and step == 0 and mb == 1:
                expect_error(RuntimeError, "set_requires_all_reduce(True)", opts[0].step)  # replica partials held
        calls = model.fsdp_comm_stats.calls
        assert calls["reduce_scatter"] == 3 * 4, f"reduce-scatters: {dict(calls)}"
        assert calls["all_reduce"] == 4, f"one all-reduce per unit across replicas: {dict(calls)}"
        average_grads(reference)
        assert_parity(model, reference, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


class VisionTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 8, kernel_size=4, stride=4)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.projector = VisionTransformer(), nn.Linear(8, 5)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))  # not vit.forward


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(MLP(), MLP())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))

    @torch.no_grad()
    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        outs = [x]
        for _ in range(steps):
            outs.append(torch.tanh(self(outs[-1])))
        return torch.stack(outs)


@check(SUITE, world_sizes=(2,))
def register_fsdp_forward_method_runs_the_hooks() -> None:
    """FSDP2's test_register_fsdp_forward_method (vit.forward_features), and a generate() calling forward."""
    torch.manual_seed(42)
    model = Model()
    reference = copy.deepcopy(model)
    fully_shard(model.vit)
    fully_shard(model.projector)
    fully_shard(model)
    register_fsdp_forward_method(model.vit, "forward_features")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not sharded: left alone, as FSDP2
    torch.manual_seed(43 + dist.get_rank())
    x = torch.randn(2, 3, 8, 8)
    loss, ref_loss = model(x).sum(), reference(x).sum()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    average_grads(reference)
    assert_parity(model, reference, "forward_features")

    torch.manual_seed(42)
    gen = Generator()
    reference = copy.deepcopy(gen)
    for block in gen.blocks:
        fully_shard(block)
    fully_shard(gen)
    register_fsdp_forward_method(gen, "generate")
    prompt = torch.randn(2, DIM)
    for _ in range(2):  # the second call re-gathers what the first left
        torch.testing.assert_close(gen.generate(prompt, 3), reference.generate(prompt, 3), rtol=1e-5, atol=1e-6)
    loss, ref_loss = gen(prompt).sum(), reference(prompt).sum()  # training after generate()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    average_grads(reference)
    assert_parity(gen, reference, "after generate")
    expect_error(ValueError, "no_such_method", register_fsdp_forward_method, gen, "no_such_method")


def copied(tree: object) -> object:
    """A copy of a state dict's tensors (a DTensor keeps its placements; ``copy.deepcopy`` is not used, see docs)."""
    def copy_tensor(t: object) -> object:
        if isinstance(t, DTensor):
            return DTensor.from_local(t.to_local().clone(), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t.clone() if isinstance(t, torch.Tensor) else t
    return tree_map(copy_tensor, tree)


@check(SUITE, world_sizes=(2,))
def torch_fsdp_module_isinstance_and_its_helpers() -> None:
    """isinstance(model, torch's FSDPModule); torch's state-dict helpers round-trip; FSDP2-only methods raise."""
    model = make_model()
    shard(model)
    assert isinstance(model, TorchFSDPModule) and isinstance(model[1], TorchFSDPModule)
    assert type(model[0:2]) is nn.Sequential, "a container slicing itself builds the original class (FSDP2's __new__)"
    expect_error(TypeError, "before fully_shard", copy.deepcopy, model)  # refused, as FSDP2 does
    expect_error(NotImplementedError, "set_custom_all_gather", model.set_custom_all_gather, None)
    try:
        torch_share_comm_ctx([model[1], model[2]])
    except NotImplementedError as exc:  # named as the user called it, not as the comprehension inside
        assert "share_comm_ctx()" in str(exc) and "listcomp" not in str(exc), exc
    else:
        raise AssertionError("share_comm_ctx must raise naming itself")
    model.set_reduce_scatter_unused_params(True)  # what ours always does: MoE code from FSDP2 keeps the line
    expect_error(NotImplementedError, "set_reduce_scatter_unused_params(False)",
                 model.set_reduce_scatter_unused_params, False)
    assert fully_shard.state(model) is model.fsdp_unit and fully_shard.state(model[1]) is model[1].fsdp_unit
    assert fully_shard.state(nn.Linear(2, 2)) is None

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        model(local_input(step)).sum().backward()
        opt.step()
        opt.zero_grad()
    full = StateDictOptions(full_state_dict=True)
    fresh = make_model()
    shard(fresh)
    set_model_state_dict(fresh, copied(get_model_state_dict(model, options=full)), options=full)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"full model state dict: {name}"
    # Sharded model and optimizer state. (A *full* optimizer state dict is laid out again by
    # torch with even Shard(0) chunks, not our shards: docs/fsdp2.md.)
    for options in (StateDictOptions(),):
        msd = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, opt, options=options)
        fresh = make_model()
        torch.manual_seed(7)
        for p in fresh.parameters():
            nn.init.normal_(p)
        shard(fresh)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fresh(local_input(9)).sum().backward()  # optimizer state exists, with other values
        fresh_opt.step()
        fresh_opt.zero_grad()
        set_model_state_dict(fresh, copied(msd), options=options)
        set_optimizer_state_dict(fresh, fresh_opt, copied(osd), options=options)  # unaliased: both step on
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), f"{options}: {name}"
            for key in ("exp_avg", "exp_avg_sq"):
                mine, theirs = opt.state[p][key], fresh_opt.state[q][key]
                assert mine.to_local().shape == theirs.to_local().shape, (
                    f"full={options.full_state_dict}: optimizer state {name}.{key} loaded as local "
                    f"{tuple(theirs.to_local().shape)} ({theirs.placements}), the parameter's shard is "
                    f"{tuple(mine.to_local().shape)} ({mine.placements})")
                assert torch.equal(mine.full_tensor(), theirs.full_tensor()), f"{options}: {name}.{key}"
        x = local_input(5)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), f"{options}: {name} after a step"


@check(SUITE, world_sizes=(2,))
def activation_checkpoint_wrappers_train_like_without() -> None:
    """torch's apply_activation_checkpointing on the blocks, then fully_shard: trains like the reference."""
    model = make_model()
    reference = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == 3
    for module in list(model.modules()):
        if isinstance(module, MLP):
            fully_shard(module)
    fully_shard(model)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(3):
        x = local_input(step)
        losses = [m(x).sum() for m in (reference, model)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        average_grads(reference)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()

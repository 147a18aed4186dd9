"""The reference's whole-model API: fully_shard_model, MegatronFSDP, fully_shard_optimizer, clipping, NaN check."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_fsdp import comm_stats
from megatron_fsdp.api.fully_shard_model import fully_shard_model
from megatron_fsdp.api.megatron_fsdp import MegatronFSDP
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.step_guard import OWN_HOOK
from megatron_fsdp.core.steps import named_sharded_parameters
from megatron_fsdp.fully_shard import fully_shard
from megatron_fsdp.optim.grad_norm import clip_grad_norm_, get_grad_norm
from megatron_fsdp.optim.optimizer import fully_shard_optimizer
from tests.distributed.core.engine_checks import assert_close_params, expect_error, world
from tests.distributed.harness import check, device_type
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "api"
STRATEGIES = (0, 1, 2, 3)


def groups_of(model: MegatronFSDP):
    return [g for u in model.fsdp_units for g in u.groups]


def full_state(model: MegatronFSDP) -> dict[str, torch.Tensor]:
    """Full main weights by FQN, whatever the modules hold now (gathered weights are kept mid-accumulation)."""
    return {k: p.full_tensor().clone() for k, p in named_sharded_parameters(model.fsdp_units, model.module)}


def compare(model: MegatronFSDP, reference: nn.Module, what: str) -> None:
    """Bitwise at 2 ranks (same summation order as DDP), else within 1e-6."""
    _, n = world()
    assert_close_params(model.module, reference, exact=(n == 2), rtol=0, atol=1e-6, what=what)


def ddp_of(base: nn.Module) -> DDP:
    return DDP(copy.deepcopy(base), find_unused_parameters=True)


def train_steps(model, opt, ddp, opt_ddp, steps: int, what: str, **step_kwargs) -> None:
    rank, n = world()
    for step in range(steps):
        batch = local_batch(step, rank, n)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(**step_kwargs)
        opt.zero_grad()
        loss_ddp = loss_fn(ddp, batch)
        loss_ddp.backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
        if n == 2:
            assert loss.item() == loss_ddp.item(), f"{what} step {step}: loss {loss.item()} vs {loss_ddp.item()}"
        compare(model, ddp.module, f"{what} step {step}")


# -- README quick start ------------------------------------------------------------


@check(SUITE)
def readme_quick_start_trains_like_ddp() -> None:
    """The quick-start code, unchanged (classes and import-path strings), for every ZeRO stage."""
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        base = Net()
        model = copy.deepcopy(base)
        YourModelLayerClass = Block  # noqa: N806 (the README's name)
        # --- README ---
        model = fully_shard_model(
            model,
            fsdp_unit_modules=[
                YourModelLayerClass,
                "tests.models.Block",
            ],
            zero_dp_strategy=strategy,
        )
        optimizer = fully_shard_optimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3)
        )
        # --- end README ---
        assert isinstance(model, MegatronFSDP) and model.module is not None
        assert not optimizer.state, "set-up must not create optimizer state (nor advance its step counter)"
        ddp = ddp_of(base)
        opt_ddp = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        train_steps(model, optimizer, ddp, opt_ddp, 4, f"quick start zero_dp_strategy={strategy}")
        steps = {int(s["step"]) for s in optimizer.state.values()}
        assert steps == {4}, f"optimizer step counters {steps} after 4 steps"
        names = [k for k, _ in model.module.named_parameters()]
        assert names == [k for k, _ in base.named_parameters()], "FQNs must be the original model's"


@check(SUITE)
def first_update_equals_ddp_bitwise() -> None:
    """The reference's set-up advanced Adam's step counter: updates were 1.3-2x smaller than DDP's."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block])
    opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ddp = ddp_of(base)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ddp, opt_ddp)):
        loss_fn(m, local_batch(0, rank, n)).backward()
        o.step()
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    compare(model, ddp.module, "first AdamW update")
    # An LR scheduler wraps the FSDP-aware step (our keywords pass through it); a closure runs before the sync.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched_ddp = torch.optim.lr_scheduler.StepLR(opt_ddp, step_size=1, gamma=0.5)
    for step in (1, 2):
        batch = local_batch(step, rank, n)
        opt.zero_grad(zero_grad_buffer=True)
        opt_ddp.zero_grad()

        def closure(m=model, b=batch):
            loss = loss_fn(m, b)
            loss.backward()
            return loss

        opt.step(closure, sync_grad_before_optimizer_step=True, install_optimized_model_weights=True)
        loss_fn(ddp, batch).backward()
        opt_ddp.step()
        scheduler.step()
        sched_ddp.step()
        compare(model, ddp.module, f"scheduled step {step}")
    assert scheduler.get_last_lr() == [1e-2 * 0.25]


# -- the one-line fully_shard(model, optimizer, ...) form --------------------------------


@check(SUITE)
def fully_shard_whole_model_form_keeps_param_groups() -> None:
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    decay = [p for k, p in model.named_parameters() if k.endswith("weight")]
    no_decay = [p for k, p in model.named_parameters() if not k.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2)
    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params")
    assert isinstance(model, MegatronFSDP)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    ddp = ddp_of(base)
    decay = [p for k, p in ddp.module.named_parameters() if k.endswith("weight")]
    no_decay = [p for k, p in ddp.module.named_parameters() if not k.endswith("weight")]
    opt_ddp = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2)
    train_steps(model, optimizer, ddp, opt_ddp, 3, "fully_shard(model, optimizer)")
    # The per-module form still works beside it, and mixing the two forms is refused.
    block = fully_shard(Block())
    assert type(block).__name__ == "FSDPBlock"
    expect_error(TypeError, "use zero_dp_strategy", fully_shard, Net(), optimizer, sharding_strategy=2)
    expect_error(TypeError, "'zero_stratgy' (did you mean 'zero_dp_strategy'?)",
                 fully_shard, Net(), fsdp_unit_modules=[Block], zero_stratgy=3)


# -- README walkthrough (mesh on CPU) -------------------------------------------------------


class InitNet(Net):
    """Net whose own parameter has an initialiser, so it can be built on the meta device."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.tiny.normal_().mul_(0.1)


def walkthrough(outer_dp_sharding_strategy: int) -> MegatronFSDP:
    rank, n = world()
    dp_outer_size, dp_shard_size, cp_size, tp_size = (2, n // 2, 1, 1) if n >= 4 else (1, n, 1, 1)
    # --- README (the device type is the harness's; the EP mesh is None: no expert parallelism) ---
    device_mesh = torch.distributed.device_mesh.init_device_mesh(
        device_type(),
        mesh_shape=(dp_outer_size, dp_shard_size, cp_size, tp_size),
        mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"),
    )
    device_mesh[("dp_outer", "dp_shard")]._flatten("dp")
    device_mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    device_mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    hsdp_group = device_mesh["hsdp"].get_group()
    expt_device_mesh = None
    with torch.device("meta"):
        model = InitNet()
    model = fully_shard_model(
        model,
        fsdp_unit_modules=[Block],
        device_mesh=device_mesh,
        dp_shard_dim="dp_shard_cp",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        hybrid_fsdp_group=hsdp_group,
        expt_device_mesh=expt_device_mesh,
        zero_dp_strategy=3,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        init_model_with_meta_device=True,
        grad_reduce_in_fp32=False,
        preserve_fp32_weights=True,
        sync_model_each_microbatch=True,
        preproc_state_dict_for_dcp_ckpt=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fully_shard_optimizer(
        optimizer,
        preproc_state_dict_for_dcp_ckpt=True,
    )
    # --- end README ---
    return model, optimizer


@check(SUITE)
def readme_walkthrough_hsdp_meta_init_trains_like_ddp() -> None:
    for outer_dp_sharding_strategy in (1, 0):
        run_walkthrough(outer_dp_sharding_strategy)


def run_walkthrough(outer_dp_sharding_strategy: int) -> None:
    model, optimizer = walkthrough(outer_dp_sharding_strategy)
    reference = Net()
    full = {k: v.full_tensor() for k, v in model.module.state_dict().items()}
    reference.load_state_dict(full)
    assert not any(p.is_meta for p in model.parameters())
    # Every rank materialised the same weights (broadcast from data-parallel rank 0).
    for name, value in full.items():
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value)
        assert all(torch.equal(g, value) for g in gathered), f"{name} differs across ranks after meta init"
    ddp = ddp_of(reference)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank, n = world()
    for step in range(3):
        batch = local_batch(step, rank, n)
        for m, o in ((model, optimizer), (ddp, opt_ddp)):
            loss_fn(m, batch).backward()
            o.step(sync_grad_before_optimizer_step=True, install_optimized_model_weights=True) if m is model \
                else o.step()
            o.zero_grad(zero_grad_buffer=True) if m is model else o.zero_grad()
        what = f"walkthrough outer_dp_sharding_strategy={outer_dp_sharding_strategy} step {step}"
        assert_close_params(model.module, ddp.module, exact=False, rtol=0, atol=1e-6, what=what)


# -- clipping -------------------------------------------------------------------------------


def check_clip(model: MegatronFSDP, base: nn.Module, what: str) -> None:
    rank, n = world()
    single = copy.deepcopy(base)
    loss_fn(single, global_batch(0, n)).backward()
    ref_params = [p for p in single.parameters() if p.grad is not None]
    ref_inf = torch.nn.utils.get_total_norm([p.grad for p in ref_params], float("inf")).item() \
        if hasattr(torch.nn.utils, "get_total_norm") else max(p.grad.abs().max().item() for p in ref_params)
    ref_norm = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05).item()
    assert ref_norm > 0.05, "the test must actually clip"

    loss_fn(model, local_batch(0, rank, n)).backward()
    ours_inf = get_grad_norm(model, float("inf")).item()
    assert abs(ours_inf - ref_inf) <= 1e-6 * ref_inf, f"{what}: inf norm {ours_inf} vs {ref_inf}"
    torch_norm = get_grad_norm(model.parameters(), 2.0).item()
    norm = clip_grad_norm_(model, 0.05).item()
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"{what}: total norm {norm} vs unsharded {ref_norm}"
    assert torch_norm == norm
    ref_grads = {k: p.grad for k, p in single.named_parameters() if p.grad is not None}
    for name, param in model.module.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(param.grad.full_tensor(), ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{what}: clipped grad {name}")
    # torch's own clip_grad_norm_ on the sharded parameters: same norm, grads now within max_norm.
    again = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    again = again.full_tensor() if isinstance(again, DTensor) else again
    assert abs(again.item() - 0.05) <= 1e-5, f"{what}: torch.nn.utils.clip_grad_norm_ after clipping gives {again}"
    model.zero_grad_buffer()


@check(SUITE)
def clip_grad_norm_equals_unsharded() -> None:
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        base = Net()
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        check_clip(model, base, f"zero_dp_strategy={strategy}")


@check(SUITE)
def torch_clip_grad_norm_on_sharded_params() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single = copy.deepcopy(base)
    loss_fn(single, global_batch(0, n)).backward()
    ref = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05).item()
    for strategy in STRATEGIES:
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        loss_fn(model, local_batch(0, rank, n)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        assert abs(norm.item() - ref) <= 1e-5 * ref, f"strategy {strategy}: torch clip norm {norm.item()} vs {ref}"
        for name, param in model.module.named_parameters():
            expected = dict(single.named_parameters())[name].grad
            if expected is not None:
                torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-5, atol=1e-7, msg=name)


@check(SUITE, world_sizes=(4,))
def clip_grad_norm_hsdp() -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for strategy, outer in [(s, 0) for s in STRATEGIES] + [(2, 1), (3, 1)]:
        torch.manual_seed(0)
        base = Net()
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                  device_mesh=mesh, outer_dp_sharding_strategy=outer)
        check_clip(model, base, f"HSDP zero_dp_strategy={strategy} outer_dp_sharding_strategy={outer}")


# -- optimizer wrapper flags --------------------------------------------------------------------


def sharded_setup(strategy=3, base: nn.Module | None = None, **options):
    torch.manual_seed(0)
    base = Net() if base is None else base
    model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **options)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ddp = ddp_of(base)
    return base, model, opt, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


@check(SUITE)
def step_sync_flag_reduces_no_sync_gradients() -> None:
    """Gradients accumulated under no_sync are reduced by step(sync_grad_before_optimizer_step=True) only."""
    rank, n = world()
    for strategy in STRATEGIES:
        base, model, opt, ddp, opt_ddp = sharded_setup(strategy)
        for m in (model, ddp):
            with m.no_sync():
                loss_fn(m, local_batch(0, rank, n)).backward()
        assert all(p.grad is None for p in model.parameters()), "no_sync must not reduce"
        before = full_state(model)
        # stepping over unreduced gradients would silently skip them: refused, naming the fix
        expect_error(RuntimeError, "no_sync()", opt.step, sync_grad_before_optimizer_step=False)
        after = full_state(model)
        assert all(torch.equal(before[k], after[k]) for k in before), "nothing reduced: the step must not move weights"
        assert any(g.grads_pending for g in groups_of(model)), "unreduced gradients must still be pending"
        # DDP under no_sync kept local gradients too; it reduces them on the next synced backward.
        opt.step()  # sync_grad_before_optimizer_step=True (default) reduces, then steps
        for p in ddp.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= n
        opt_ddp.step()
        compare(model, ddp.module, f"no_sync + step(sync) strategy {strategy}")


@check(SUITE)
def step_install_flag_refreshes_compute_weights() -> None:
    """bf16 compute, fp32 main: install=True casts the new main weights at once, False at the next gather."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16)
    results = {}
    for install in (True, False):
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=2)
        groups = [g for g in groups_of(model) if g.requires_grad]
        assert all(g.compute_dtype == torch.bfloat16 and g.dtype == torch.float32 for g in groups)
        opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        loss_fn(model, local_batch(0, rank, n)).backward()
        refreshes = [g.refreshes for g in groups]
        opt.step(install_optimized_model_weights=install)
        opt.zero_grad()
        if install:
            assert [g.refreshes for g in groups] == [r + 1 for r in refreshes], "install=True refreshes at the step"
            for g in groups:
                assert torch.equal(g.compute_shard, g.shard.to(torch.bfloat16)), "compute copy is the new main weights"
        else:
            assert [g.refreshes for g in groups] == refreshes and all(g.compute_stale for g in groups)
        results[install] = loss_fn(model, local_batch(1, rank, n)).item()
        assert all(not g.compute_stale for g in groups), "the next forward uses refreshed weights"
    assert results[True] == results[False], results


@check(SUITE)
def zero_grad_buffer_flag() -> None:
    """zero_grad(zero_grad_buffer=True) drops gradients accumulated under no_sync; False keeps them."""
    rank, n = world()
    for keep in (False, True):
        base, model, opt, ddp, opt_ddp = sharded_setup(1)
        for m in (model, ddp):
            with m.no_sync():
                loss_fn(m, local_batch(0, rank, n)).backward()
        opt.zero_grad(zero_grad_buffer=not keep)
        if not keep:
            opt_ddp.zero_grad()
        for m in (model, ddp):
            loss_fn(m, local_batch(1, rank, n)).backward()
        opt.step()
        opt_ddp.step()
        compare(model, ddp.module, f"zero_grad(zero_grad_buffer={not keep})")


# -- NaN / Inf check ------------------------------------------------------------------------------


def poison_on_rank1(model: MegatronFSDP, fqn: str) -> None:
    """Make ``fqn``'s local gradient NaN on rank 1 only (before the reduction)."""
    if dist.get_rank() != 1:
        return
    for unit in model.fsdp_units:
        for group in unit.groups:
            for ref, param in zip(group.refs, group.unsharded_params):
                owner = dict(model.module.named_modules()).get(fqn[: -len(ref.fqn) - 1])
                if fqn.endswith(ref.fqn) and unit.module is owner:
                    param.register_hook(lambda g: torch.full_like(g, float("nan")))
                    return
    raise AssertionError(f"no parameter {fqn}")


@check(SUITE)
def nan_check_names_parameter_on_every_rank() -> None:
    rank, n = world()
    for strategy in (0, 3):
        torch.manual_seed(0)
        model = fully_shard_model(Net(), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                  check_for_nan_in_grad=True)
        opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), check_for_nan_in_grad=True)
        poison_on_rank1(model, "blocks.1.up.weight")
        before = full_state(model)
        loss_fn(model, local_batch(0, rank, n)).backward()
        expect_error(RuntimeError, "blocks.1.up.weight", opt.step)
        expect_error(RuntimeError, "1 parameter(s)", model.finish_grad_sync)
        after = full_state(model)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, f"a failed check must not step; changed: {changed}"
        # Without the check the step runs (the NaN goes into the weights).
        opt.step(check_for_nan_in_grad=False)


# -- MegatronFSDP methods ---------------------------------------------------------------------------


@check(SUITE)
def state_dict_keys_and_round_trip() -> None:
    torch.manual_seed(0)
    base = Net()
    model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block])
    keys = list(model.state_dict())
    assert keys == list(base.state_dict()), keys[:4]  # the wrapper adds no "module." prefix
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    model.load_state_dict(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), saved[k]), k
    rank, n = world()
    loss = loss_fn(model, local_batch(0, rank, n)).item()
    assert loss == loss_fn(base, local_batch(0, rank, n)).item(), "loaded weights are used by the next forward"
    # After a forward no backward followed, ZeRO-1 keeps gathered bf16 weights installed; a checkpoint must
    # still see the fp32 main shards (model.state_dict() and DCP's get_model_state_dict(model.module) alike).
    # (An evaluation forward under no_grad reshards: engine_checks.optimizer_built_after_evaluation_trains_right.)
    model = fully_shard_model(copy.deepcopy(base).to(torch.bfloat16), fsdp_unit_modules=[Block], zero_dp_strategy=1)
    loss_fn(model, local_batch(0, rank, n))
    assert any(not isinstance(p, DTensor) for p in model.module.parameters()), "test premise: weights gathered"
    for sd in (model.state_dict(), get_model_state_dict(model.module)):
        bad = [k for k, v in sd.items() if not isinstance(v, DTensor) or v.dtype != torch.float32]
        assert not bad, f"state dict holds gathered compute weights: {bad}"
    loss_fn(model, local_batch(0, rank, n))  # and the model still runs after it


@check(SUITE)
def no_sync_then_finish_grad_sync_matches_ddp_accumulation() -> None:
    rank, n = world()
    for strategy in STRATEGIES:
        base, model, opt, ddp, opt_ddp = sharded_setup(strategy)
        for step in range(2):
            for micro in range(3):
                batch = local_batch(3 * step + micro, rank, n)
                for m in (model, ddp):
                    ctx = m.no_sync() if micro < 2 else torch.enable_grad()
                    with ctx:
                        (loss_fn(m, batch) / 3).backward()
            model.start_grad_sync()
            model.finish_grad_sync()
            model.scale_gradients(0.5)
            for p in ddp.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
            opt.step(sync_grad_before_optimizer_step=False)
            model.zero_grad_buffer()
            assert all(p.grad is None for p in model.parameters())
            opt_ddp.step()
            opt_ddp.zero_grad()
            compare(model, ddp.module, f"no_sync accumulation strategy {strategy} step {step}")
        model.stop_communication()
        assert all(not u.root_state._in_flight for u in model.fsdp_units if u.root_state is not None)


@check(SUITE)
def sync_model_each_microbatch_false_gathers_once_per_step() -> None:
    rank, n = world()
    gathers = {}
    for sync in (True, False):
        base, model, opt, ddp, opt_ddp = sharded_setup(2, sync_model_each_microbatch=sync)
        for step in range(2):
            comm_stats.reset()
            for micro in range(3):
                batch = local_batch(3 * step + micro, rank, n)
                (loss_fn(model, batch) / 3).backward()
                (loss_fn(ddp, batch) / 3).backward()
            gathers[sync] = comm_stats.calls["all_gather"]
            opt.step()
            opt.zero_grad()
            opt_ddp.step()
            opt_ddp.zero_grad()
            # DDP all-reduces the accumulated gradient each micro-batch (rounding differs): not bitwise.
            what = f"sync_model_each_microbatch={sync} step {step}"
            assert_close_params(model.module, ddp.module, exact=False, rtol=0, atol=1e-6, what=what)
        if rank == 0:
            print(f"ZeRO-2, 3 micro-batches, n={n}: sync_model_each_microbatch={sync}: {gathers[sync]} gathers/step")
    assert gathers[False] * 3 == gathers[True], gathers


@check(SUITE)
def broadcast_params_restores_replicas() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    cases = [(0, None, 0), (3, None, 0)]
    if n >= 4:
        mesh = init_device_mesh(device_type(), (2, n // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        cases += [(0, mesh, 0), (3, mesh, 0), (3, mesh, 1)]
    for strategy, mesh, outer in cases:
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                  device_mesh=mesh, outer_dp_sharding_strategy=outer)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(float(rank))  # replicas (and shards) diverge
        model.broadcast_params()
        loss = loss_fn(model, local_batch(0, 0, n))
        losses = [torch.zeros(()) for _ in range(n)]
        dist.all_gather(losses, loss.detach())
        assert all(torch.equal(x, losses[0]) for x in losses), f"replicas differ after broadcast_params: {losses}"
        if strategy == 0 or mesh is not None:  # every replica now holds DP rank 0's values
            for name, value in full_state(model).items():
                gathered = [torch.empty_like(value) for _ in range(n)]
                dist.all_gather(gathered, value)
                assert all(torch.equal(g, value) for g in gathered), f"{name} differs across ranks"
                if strategy == 0:  # rank 0 added 0: its values are the original ones
                    assert torch.equal(value, dict(base.named_parameters())[name].detach()), name


@check(SUITE)
def options_map_onto_the_engine() -> None:
    rank, n = world()
    # overlap flags
    base, model, opt, ddp, opt_ddp = sharded_setup(3, overlap_grad_reduce=False, overlap_param_gather=False)
    train_steps(model, opt, ddp, opt_ddp, 2, "no overlap")
    assert model.module.fsdp_unit.root_state.max_in_flight == 0
    assert all(u.prefetch_depth == 0 for u in model.fsdp_units)
    # fine-grained gather: every parameter-owning module inside a Block is its own unit
    base, model, opt, ddp, opt_ddp = sharded_setup(3, enable_fine_grained_param_gather=True)
    kinds = sorted(type(u.module).__name__ for u in model.fsdp_units)
    assert kinds.count("FSDPLinear") == 8 and kinds.count("FSDPLayerNorm") == 4, kinds
    train_steps(model, opt, ddp, opt_ddp, 2, "fine-grained")
    # per-token loss: summed gradients
    torch.manual_seed(0)
    base = Net()
    model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], calculate_per_token_loss=True)
    ddp = ddp_of(base)
    for m in (model, ddp):
        loss_fn(m, local_batch(0, rank, n)).backward()
    model.finish_grad_sync()
    for name, p in model.module.named_parameters():
        ref = dict(ddp.module.named_parameters())[name].grad
        if ref is not None:
            torch.testing.assert_close(p.grad.full_tensor(), ref * n, rtol=1e-6, atol=1e-7, msg=name)
    # precision flags on a bf16-built model
    for preserve, fp32_reduce, main, comm in ((True, False, torch.float32, torch.bfloat16),
                                               (True, True, torch.float32, torch.float32),
                                               (False, False, torch.bfloat16, torch.bfloat16)):
        model = fully_shard_model(Net().to(torch.bfloat16), fsdp_unit_modules=[Block],
                                  preserve_fp32_weights=preserve, grad_reduce_in_fp32=fp32_reduce)
        for g in groups_of(model):
            assert (g.compute_dtype, g.dtype, g.comm_dtype) == (torch.bfloat16, main, comm), (
                preserve, fp32_reduce, g.compute_dtype, g.dtype, g.comm_dtype)


@check(SUITE)
def bad_input_errors() -> None:
    expect_error(ValueError, "'tests.models.NoSuchBlock'", fully_shard_model, Net(),
                 fsdp_unit_modules=["tests.models.NoSuchBlock"])
    expect_error(ValueError, "'no_such_pkg.Block'", fully_shard_model, Net(), fsdp_unit_modules=["no_such_pkg.Block"])
    expect_error(TypeError, "valid options:", fully_shard_model, Net(), zero_dp_stratgy=3)
    expect_error(ValueError, "tp_dim='tp'", fully_shard_model, Net(), tp_dim="tp")
    expect_error(NotImplementedError, "nccl_ub", fully_shard_model, Net(), nccl_ub=True)
    expect_error(TypeError, "expt_device_mesh must be a DeviceMesh", fully_shard_model, Net(),
                 expt_device_mesh=object())
    expect_error(ValueError, "outer_dp_sharding_strategy=2", fully_shard_model, Net(), outer_dp_sharding_strategy=2)
    expect_error(ValueError, "zero_dp_strategy=5", fully_shard_model, Net(), zero_dp_strategy=5)
    expect_error(ValueError, "hybrid_fsdp_group is only for HSDP", fully_shard_model, Net(),
                 hybrid_fsdp_group=dist.group.WORLD)
    expect_error(ValueError, "device='meta'", fully_shard_model, Net(), device="meta")
    plain = torch.optim.SGD(Net().parameters(), lr=0.1)
    expect_error(ValueError, "not sharded parameters", fully_shard_optimizer, plain)
    model = fully_shard_model(Net(), fsdp_unit_modules=[Block])
    expect_error(ValueError, "already sharded", fully_shard_model, model)
    expect_error(TypeError, "second argument must be a torch.optim.Optimizer", fully_shard, Net(), "adam",
                 fsdp_unit_modules=[Block])


@check(SUITE)
def start_param_sync_installs_changed_main_weights() -> None:
    """Main weights changed outside a step (e.g. by a custom update): start_param_sync makes forward use them."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16)
    for strategy in (1, 3):
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        batch = local_batch(0, rank, n)
        loss_fn(model, batch)  # ZeRO-1 keeps its gathered bf16 weights after a forward
        with torch.no_grad():
            for p in model.sharded_parameters():
                p.to_local().mul_(0.5)
        model.start_param_sync()
        groups = [g for g in groups_of(model) if g.requires_grad]
        assert all(torch.equal(g.compute_shard, g.shard.to(torch.bfloat16)) for g in groups)
        expected = copy.deepcopy(base)
        with torch.no_grad():
            for p in expected.parameters():
                p.copy_((p.float() * 0.5).to(torch.bfloat16))
        assert loss_fn(model, batch).item() == loss_fn(expected, batch).item(), f"strategy {strategy}"
        model.stop_communication()  # a forward without backward may leave a prefetch in flight
        assert all(g._gather is None for g in groups_of(model))


@check(SUITE)
def bf16_built_model_maps_to_policy_and_tracks_fp32_ddp() -> None:
    """Megatron's set-up: model built in bf16, fp32 main weights (defaults), bf16 or fp32 gradient reduction.

    Exact: the same as an fp32-built model with the equivalent explicit MixedPrecisionPolicy.
    Loose: tracks fp32 DDP (bf16 forward/backward noise; the figures are printed).
    """
    rank, n = world()
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16).float()  # bf16-representable weights: both builds start equal
    ddp = ddp_of(base)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    steps = 10
    for step in range(steps):
        ddp_loss = loss_fn(ddp, local_batch(step, rank, n))
        ddp_loss.backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
    figures = {}
    for fp32_reduce in (False, True):
        built_bf16 = fully_shard_model(copy.deepcopy(base).to(torch.bfloat16), fsdp_unit_modules=[Block],
                                       grad_reduce_in_fp32=fp32_reduce)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                                      grad_comm_dtype=torch.float32 if fp32_reduce else torch.bfloat16)
        explicit = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], mp_policy=policy)
        losses = {}
        for model in (built_bf16, explicit):
            opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            for step in range(steps):
                loss = loss_fn(model, local_batch(step, rank, n))
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses[id(model)] = loss.item()
        main = full_state(built_bf16)
        assert all(v.dtype == torch.float32 for v in main.values())
        assert main.keys() == full_state(explicit).keys()
        for name, value in full_state(explicit).items():
            assert torch.equal(main[name], value), f"bf16-built vs explicit policy (fp32_reduce={fp32_reduce}): {name}"
        worst = max(((main[name] - p).norm() / p.norm()).item() for name, p in ddp.module.named_parameters())
        figures[fp32_reduce] = (worst, abs(losses[id(built_bf16)] - ddp_loss.item()) / ddp_loss.item())
    if rank == 0:
        for fp32_reduce, (worst, loss_err) in figures.items():
            print(f"bf16-built model, {steps} AdamW steps, n={n}, grad_reduce_in_fp32={fp32_reduce}: worst relative "
                  f"L2 error of fp32 main weights vs fp32 DDP {worst:.2e}, final loss relative error {loss_err:.2e}")
    assert all(w < 3e-2 and e < 3e-2 for w, e in figures.values()), figures  # bf16 eps is 7.8e-3


@check(SUITE, world_sizes=(4,))
def clip_grad_norm_across_model_parallel_group() -> None:
    """(tp=2, dp=2): each TP rank holds a different model (like TP-split weights); the norm spans both."""
    rank, n = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("tp", "dp"))
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    torch.manual_seed(10 + tp_rank)
    base = Net()
    single = copy.deepcopy(base)
    loss_fn(single, global_batch(0, 2)).backward()
    own = torch.nn.utils.get_total_norm([p.grad for p in single.parameters() if p.grad is not None]) \
        if hasattr(torch.nn.utils, "get_total_norm") else \
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in single.parameters() if p.grad is not None]))
    norms = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(norms, own.reshape(()), group=mesh.get_group("tp"))
    expected = torch.stack(norms).norm().item()
    model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], device_mesh=mesh,
                              dp_shard_dim="dp", tp_dim="tp")
    loss_fn(model, local_batch(0, dp_rank, 2)).backward()
    assert abs(get_grad_norm(model).item() - own.item()) <= 1e-5 * own.item(), "without the group: own model only"
    total = clip_grad_norm_(model, 0.05, model_parallel_group=mesh.get_group("tp")).item()
    assert abs(total - expected) <= 1e-5 * expected, f"norm over TP ranks {total} vs {expected}"
    coef = 0.05 / (expected + 1e-6)
    for name, p in model.module.named_parameters():
        ref = dict(single.named_parameters())[name].grad
        if ref is not None:
            torch.testing.assert_close(p.grad.full_tensor(), ref * coef, rtol=1e-5, atol=1e-8, msg=name)


@check(SUITE)
def local_shard_step_equals_dtensor_step_bitwise() -> None:
    """``step_on_local_shards`` (the default) gives the DTensor step's numbers and state, bit for bit."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    for strategy in (1, 3):
        for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
            runs = []
            for local in (True, False):
                model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
                opt = fully_shard_optimizer(make(model.parameters()), step_on_local_shards=local)
                seen: list[bool] = []  # per step: did the optimizer's own step see plain local tensors?

                # A user's step hook turns the local step off (it would see local aliases); this
                # observer is marked as the library's own so that it does not, and is global so that
                # it runs where a user's hook would, inside the window.
                def observe(o, *_, opt=opt, seen=seen):
                    if o is opt:
                        seen.append(not any(isinstance(p, DTensor) for g in o.param_groups for p in g["params"]))

                setattr(observe, OWN_HOOK, True)
                handle = register_optimizer_step_pre_hook(observe)
                try:
                    for step in range(3):  # step 0 creates the state (plain path), then local steps
                        loss_fn(model, local_batch(step, rank, n)).backward()
                        opt.step()
                        opt.zero_grad()
                finally:
                    handle.remove()
                assert seen == ([False, True, True] if local else [False] * 3), (strategy, local, seen)
                runs.append((model, opt))
            what = f"strategy {strategy} {type(runs[0][1]).__name__}"
            (fast, fast_opt), (plain, plain_opt) = runs
            for (name, a), (_, b) in zip(named_sharded_parameters(fast.fsdp_units, fast.module),
                                         named_sharded_parameters(plain.fsdp_units, plain.module), strict=True):
                assert torch.equal(a.to_local(), b.to_local()), f"{what}: {name}"
                state_a, state_b = fast_opt.state[a], plain_opt.state[b]
                assert state_a.keys() == state_b.keys(), (what, name, state_a.keys(), state_b.keys())
                for key in state_a:
                    x, y = state_a[key], state_b[key]
                    assert type(x) is type(y), f"{what}: {name}.{key} is {type(x).__name__}, not {type(y).__name__}"
                    if isinstance(x, DTensor):
                        assert x.placements == y.placements and x.shape == y.shape, (what, name, key)
                        x, y = x.to_local(), y.to_local()
                    assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), f"{what}: {name}.{key}"
            # the parameters the optimizer holds are the model's sharded DTensors again
            assert all(isinstance(p, DTensor) for g in fast_opt.param_groups for p in g["params"]), what
            assert all(p.grad is None for g in fast_opt.param_groups for p in g["params"]), what


@check(SUITE, params={"strategy": [1, 3]})
def full_state_dicts_resume_a_wrapped_optimizer(strategy: int) -> None:
    """Megatron's path resumed from full (consolidated) state dicts: model and optimizer loaded into
    a fresh fully_shard_model + fully_shard_optimizer continue bitwise (the state is re-cut into
    our ragged shards; torch cuts it at torch.chunk boundaries); the sharded state dict survives
    copy.deepcopy and torch.save."""
    rank, n = world()
    options = StateDictOptions(full_state_dict=True)

    def build():
        torch.manual_seed(0)
        model = fully_shard_model(Net(), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def run(model, opt, steps) -> None:
        for step in steps:
            loss_fn(model, local_batch(step, rank, n)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    run(model, opt, range(2))
    saved_model = copy.deepcopy(get_model_state_dict(model, options=options))
    saved_opt = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))  # `step` tensors alias
    sharded_copy = copy.deepcopy(model.state_dict())
    torch.save(model.state_dict(), io.BytesIO())
    run(model, opt, range(2, 4))
    expected = full_state(model)

    resumed, resumed_opt = build()
    set_model_state_dict(resumed, saved_model, options=options)
    # Net has parameters that never get a gradient, so no state: torch's strict check refuses that.
    set_optimizer_state_dict(resumed, resumed_opt, saved_opt,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    for key, value in resumed.state_dict().items():
        assert torch.equal(value.to_local(), sharded_copy[key].to_local()), f"{key} after loading the full state"
    run(resumed, resumed_opt, range(2, 4))
    for key, value in full_state(resumed).items():
        assert torch.equal(value, expected[key]), f"zero_dp_strategy={strategy} {key} differs after resuming"

"""FSDP2's ``fully_shard`` keywords on ``megatron_fsdp.fully_shard``, compared with FSDP2 itself.

Each scenario builds the same model twice, shards one with PyTorch's
``torch.distributed.fsdp.fully_shard`` and one with ours using the same keywords,
trains both on the same per-rank batches and compares losses and full weights:
bitwise, as the same machine computes the same casts in the same order (at 2
ranks the mean's division by the world size is exact).
PyTorch's DTensors live on a mesh with other dimension names, so DTensor's
sharding-propagation cache never mixes theirs with ours (docs/api.md, known limit).
Scenarios follow PyTorch's test/distributed/_composable/fsdp/ tests
(test_fully_shard_mixed_precision.py, test_fully_shard_ignore_params.py and the
grouped-modules cases of test_fully_shard_training.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from megatron_fsdp.core.lookup import units_of
from tests.distributed.harness import check, device_type

SUITE = "fsdp2_keywords"
TorchMP = torch_fsdp.MixedPrecisionPolicy
DIM = 16


class Attention(nn.Module):
    """Stands in for attention: a norm and a projection (records its input dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.seen_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_dtype = x.dtype
        return self.proj(self.norm(x.to(self.proj.weight.dtype)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM + 3), nn.GELU(), nn.Linear(2 * DIM + 3, DIM))
        self.seen_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_dtype = x.dtype
        x = x + self.attn(x.float())  # fp32 in: what reaches attn shows whether its unit casts inputs
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(self.head.weight.dtype))  # blocks may return output_dtype


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def torch_mesh():
    """FSDP2's mesh: every rank, under a dimension name ours never uses."""
    return init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("fsdp2_reference",))


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p).clone() for name, p in model.named_parameters()}


def batch(step: int) -> torch.Tensor:
    """This rank's slice of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4 * dist.get_world_size(), 5, generator=g)
    return x.chunk(dist.get_world_size())[dist.get_rank()]


def train(model: nn.Module, steps: int = 3, after_backward: Callable[[int], None] | None = None) -> list[float]:
    """AdamW steps on ``model``; the global mean loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(batch(step)).float().square().mean()
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def assert_same_training(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    """Both train alike: losses and full weights bitwise equal."""
    losses = (train(ours), train(theirs))
    assert_bitwise(losses, what + ": losses")
    assert_bitwise((full_state(ours), full_state(theirs)), what)


def assert_bitwise(pair: tuple, what: str) -> None:
    torch.testing.assert_close(pair[0], pair[1], rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def train_replicated_with_casts(net: Net, compute: torch.dtype, steps: int = 3) -> tuple[list[float], dict]:
    """DDP with FSDP2's casts, by hand: fp32 main weights, a ``compute`` copy runs the
    rank's batch, its gradients are all-reduced in fp32 and averaged, AdamW steps the main weights."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        copy = make_net().to(compute)
        copy.load_state_dict(net.state_dict())
        loss = copy(batch(step).to(compute)).float().square().mean()
        loss.backward()
        for main, low in zip(net.parameters(), copy.parameters()):
            grad = low.grad.float()
            dist.all_reduce(grad)
            main.grad = grad / dist.get_world_size()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses, full_state(net)


def shard_both(apply_ours: Callable[[Net], None], apply_theirs: Callable[[Net], None]) -> tuple[Net, Net]:
    ours, theirs = make_net(), make_net()
    apply_ours(ours)
    apply_theirs(theirs)
    return ours, theirs


@check(SUITE, (2,))
def fsdp2_mixed_precision_policy_trains_like_fsdp2() -> None:
    """torch's MixedPrecisionPolicy, passed to ours, trains as FSDP2 with it (bf16 compute, fp32 or bf16 reduce)."""
    policies = (
        TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        TorchMP(param_dtype=torch.bfloat16),  # reduce_dtype None: the reduction runs in bf16, as FSDP2
        TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32),
    )
    for policy in policies:
        def apply(fn, mesh_kw, policy=policy):
            def go(net: Net) -> None:
                for block in net.blocks:
                    fn(block, mp_policy=policy, **mesh_kw)
                fn(net, mp_policy=policy, **mesh_kw)
            return go

        ours, theirs = shard_both(apply(fully_shard, {}), apply(torch_fsdp.fully_shard, {"mesh": torch_mesh()}))
        # Same machine, same casts, same per-rank batches, 2 ranks (the mean's division
        # by 2 is exact): bitwise.
        assert_same_training(ours, theirs, what=str(policy))
        if policy.reduce_dtype == torch.float32:  # and as DDP with the same casts
            ddp_losses, ddp_state = train_replicated_with_casts(make_net(), torch.bfloat16)
            ours_again = make_net()
            apply(fully_shard, {})(ours_again)
            assert_bitwise((train(ours_again), ddp_losses), f"{policy} vs DDP: losses")
            assert_bitwise((full_state(ours_again), ddp_state), f"{policy} vs DDP")
        # Probed after training: FSDP2's root keeps its unsharded parameters registered
        # after a no_grad forward, so an optimizer built after one would step those.
        with torch.no_grad():
            out_ours, out_theirs = ours(batch(0)), theirs(batch(0))
        expected = policy.output_dtype or torch.bfloat16
        assert out_ours.dtype == out_theirs.dtype == expected, (policy, out_ours.dtype, out_theirs.dtype)
        # cast_forward_inputs: each unit's (block's) input arrives in param_dtype; attn is no unit
        seen = [(b.seen_dtype, b.attn.seen_dtype) for b in ours.blocks]
        assert seen == [(b.seen_dtype, b.attn.seen_dtype) for b in theirs.blocks], seen
        assert seen == [(torch.bfloat16, torch.float32)] * 2, seen
        for name, param in ours.named_parameters():  # FSDP2's meaning: main weights keep their dtype
            assert param.dtype == torch.float32, (name, param.dtype)


@check(SUITE, (2,))
def output_dtype_and_cast_forward_inputs_in_our_policy() -> None:
    """Ours' output_dtype and cast_forward_inputs=False as FSDP2's: dtypes at every boundary and training."""
    ours_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=None,
                                       grad_comm_dtype=torch.float32, output_dtype=torch.float32)
    ours_attn = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=None,
                                     grad_comm_dtype=torch.float32, cast_forward_inputs=False)
    theirs_policy = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    theirs_attn = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def apply_ours(net: Net) -> None:
        for block in net.blocks:
            fully_shard(block.attn, mp_policy=ours_attn)
            fully_shard(block, mp_policy=ours_policy)
        fully_shard(net, mp_policy=ours_policy)

    def apply_theirs(net: Net) -> None:
        mesh = torch_mesh()
        for block in net.blocks:
            torch_fsdp.fully_shard(block.attn, mesh=mesh, mp_policy=theirs_attn)
            torch_fsdp.fully_shard(block, mesh=mesh, mp_policy=theirs_policy)
        torch_fsdp.fully_shard(net, mesh=mesh, mp_policy=theirs_policy)

    ours, theirs = shard_both(apply_ours, apply_theirs)
    assert_same_training(ours, theirs, what="our policy with output_dtype")
    with torch.no_grad():
        assert ours(batch(0)).dtype == theirs(batch(0)).dtype == torch.float32
    seen = [(b.seen_dtype, b.attn.seen_dtype) for b in ours.blocks]
    assert seen == [(b.seen_dtype, b.attn.seen_dtype) for b in theirs.blocks], seen
    # blocks cast their (fp32, output_dtype) input to bf16; attn takes the fp32 it is given
    assert seen == [(torch.bfloat16, torch.float32)] * 2, seen


@check(SUITE, (2,))
def reshard_after_forward_none_is_fsdp2s_default() -> None:
    """None: non-root units free their weights after forward, the root keeps them; trains as FSDP2's default."""
    def apply_ours(net: Net) -> None:
        for block in net.blocks:
            fully_shard(block, reshard_after_forward=None)
        fully_shard(net, reshard_after_forward=None)

    def apply_theirs(net: Net) -> None:
        mesh = torch_mesh()
        for block in net.blocks:
            torch_fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=None)
        torch_fsdp.fully_shard(net, mesh=mesh, reshard_after_forward=None)

    ours, theirs = shard_both(apply_ours, apply_theirs)
    loss = ours(batch(0)).square().mean()
    states = {type(u.module).__name__: {g.state.value for g in u.groups} for u in units_of(ours)}
    assert states == {"FSDPNet": {"unsharded"}, "FSDPBlock": {"sharded"}}, states
    loss.backward()
    ours.zero_grad()
    theirs(batch(0)).square().mean().backward()
    theirs.zero_grad()
    assert_same_training(ours, theirs, what="reshard_after_forward=None")


@check(SUITE, (2,))
def ignored_params_stay_plain_and_unreduced() -> None:
    """ignored_params: plain local parameters with per-rank gradients; the rest trains as FSDP2."""
    def apply(fn, **mesh_kw):
        def go(net: Net) -> None:
            fn(net.blocks[0], ignored_params={net.blocks[0].mlp[0].bias}, **mesh_kw)
            fn(net.blocks[1], **mesh_kw)
            fn(net, ignored_params={net.inp.weight, net.head.bias}, **mesh_kw)
        return go

    ours, theirs = make_net(), make_net()
    kept = {name: p for name, p in ours.named_parameters()}
    apply(fully_shard)(ours)
    apply(torch_fsdp.fully_shard, mesh=torch_mesh())(theirs)
    ignored = ("inp.weight", "head.bias", "blocks.0.mlp.0.bias")
    for name, param in ours.named_parameters():
        if name in ignored:
            assert param is kept[name] and not isinstance(param, DTensor), name  # untouched, as FSDP2
        else:
            assert isinstance(param, DTensor), name
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in ignored}

    def record(model: nn.Module) -> Callable[[int], None]:
        def after_backward(step: int) -> None:
            for name, param in model.named_parameters():
                if name in ignored:
                    grads[name].append(param.grad.clone())
        return after_backward

    losses = (train(ours, after_backward=record(ours)), train(theirs, after_backward=record(theirs)))
    assert_bitwise(losses, "losses")
    for name in ignored:  # ours' and FSDP2's local (unreduced) gradients, step by step: bitwise
        mine, ref = grads[name][:3], grads[name][3:]
        assert_bitwise((mine, ref), name)
        # unreduced: each rank keeps its own batch's gradient (the ranks' batches differ)
        other = [torch.empty_like(mine[0]) for _ in range(dist.get_world_size())]
        dist.all_gather(other, mine[0].contiguous())
        assert not torch.equal(other[0], other[1]), name
    assert_bitwise((full_state(ours), full_state(theirs)), "weights")


@check(SUITE, (2,))
def list_of_modules_is_one_unit() -> None:
    """fully_shard([block.attn, block.mlp]): one unit, one gather per forward, trains as FSDP2's grouping."""
    def apply(fn, **mesh_kw):
        def go(net: Net) -> None:
            for block in net.blocks:
                pair = [block.attn, block.mlp]
                assert fn(pair, **mesh_kw) is pair  # FSDP2 returns its argument
            fn(net, **mesh_kw)
        return go

    ours, theirs = shard_both(apply(fully_shard), apply(torch_fsdp.fully_shard, mesh=torch_mesh()))
    for block in ours.blocks:
        assert isinstance(block.attn, FSDPModule) and isinstance(block.mlp, FSDPModule)
        assert type(block.attn).__name__ == "FSDPAttention" and type(block.mlp).__name__ == "FSDPSequential"
        assert block.attn.fsdp_unit is block.mlp.fsdp_unit
        assert not isinstance(block, FSDPModule)
    units = units_of(ours)
    assert len(units) == 3, len(units)  # the root and one per block, each listed once
    stats = ours.fsdp_comm_stats
    with torch.no_grad():
        ours(batch(0))  # the first forward also agrees on orders; count the second
        stats.reset()
        ours(batch(0))
    assert stats.calls["all_gather"] == 3, dict(stats.calls)  # one per unit, not one per module
    # each grouped unit gathers before attn and frees after mlp, not in between
    observed = []
    for block in ours.blocks:
        block.attn.register_forward_hook(lambda m, i, o, b=block: observed.append(
            {g.state.value for g in b.attn.fsdp_unit.groups}))
    loss = ours(batch(0)).square().mean()
    assert observed == [{"unsharded"}, {"unsharded"}], observed
    assert all({g.state.value for g in u.groups} == {"sharded"} for u in units[1:])
    loss.backward()
    ours.zero_grad()
    assert_same_training(ours, theirs, what="grouped attn+mlp")
    # state_dict: the plain model's keys, and loading a plain model's values reproduces it
    plain = make_net()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    assert set(ours.state_dict()) == set(plain.state_dict())
    ours.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ours(batch(1)), plain(batch(1)), rtol=1e-6, atol=1e-6)


@check(SUITE, (2,))
def shard_placement_fn_dim0_is_the_default_layout() -> None:
    """shard_placement_fn returning None or Shard(0) shards as the default; Shard(1) is refused by name."""
    def by_name(net: Net) -> Callable[[nn.Parameter], Shard | None]:
        names = {id(p): n for n, p in net.named_parameters()}
        return lambda p: Shard(0) if names[id(p)].endswith("weight") else None

    reference, ours = make_net(), make_net()
    for block in reference.blocks:
        fully_shard(block)
    fully_shard(reference)
    fn = by_name(ours)
    for block in ours.blocks:
        fully_shard(block, shard_placement_fn=fn)
    fully_shard(ours, shard_placement_fn=fn)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        assert a.placements == b.placements and a.to_local().shape == b.to_local().shape, name
    losses = (train(ours), train(reference))
    assert losses[0] == losses[1], losses  # the same layout: bitwise
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        assert torch.equal(full(a), full(b)), name
    refused = make_net()
    try:
        fully_shard(refused.blocks[0], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    except NotImplementedError as exc:
        assert "'attn.proj.weight'" in str(exc) and "Shard(1)" in str(exc), exc
    else:
        raise AssertionError("Shard(1) was accepted")
    assert not isinstance(refused.blocks[0], FSDPModule)


@check(SUITE, (2,))
def dp_mesh_dims_names_the_data_parallel_dimensions() -> None:
    """DataParallelMeshDims(shard=, replicate=) on a named 2-D mesh trains as dp_shard_dim/dp_outer_dim."""
    dims_cls = getattr(torch_fsdp, "DataParallelMeshDims", None)
    if dims_cls is None:  # torch 2.11: no such class; the keyword needs one
        return
    mesh = init_device_mesh(device_type(), (1, dist.get_world_size()), mesh_dim_names=("rep", "shard"))
    ours, reference = make_net(), make_net()
    for block in ours.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims_cls(shard="shard", replicate="rep"))
    fully_shard(ours, mesh=mesh, dp_mesh_dims=dims_cls(shard=("shard",), replicate="rep"))
    for block in reference.blocks:
        fully_shard(block, mesh=mesh, dp_shard_dim="shard", dp_outer_dim="rep")
    fully_shard(reference, mesh=mesh, dp_shard_dim="shard", dp_outer_dim="rep")
    losses = (train(ours), train(reference))
    assert losses[0] == losses[1], losses  # the same mesh dimensions: bitwise
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        assert torch.equal(full(a), full(b)), name
    for bad, error in ((dims_cls(shard=("rep", "shard")), NotImplementedError),
                       (dims_cls(replicate="rep"), NotImplementedError)):
        try:
            fully_shard(make_net(), mesh=mesh, dp_mesh_dims=bad)
        except error as exc:
            assert "dp_mesh_dims" in str(exc), exc
        else:
            raise AssertionError(f"{bad} was accepted")


class HiddenNet(Net):
    """``Net`` whose forward stops before the head: the loss runs the head per chunk (chunked loss)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def chunked_loss(net: HiddenNet, x: torch.Tensor) -> torch.Tensor:
    hidden = net(x)
    return sum(net.head(chunk).square().sum() for chunk in hidden.chunk(2)) / (hidden.shape[0] * 3)


@check(SUITE, (2,))
def grouped_unit_with_a_module_run_after_the_forward() -> None:
    """fully_shard([last block, head]) with the head called per chunk after the model's forward, as FSDP2."""
    def build(fn, **mesh_kw) -> HiddenNet:
        torch.manual_seed(0)
        net = HiddenNet()
        fn(net.blocks[0], **mesh_kw)
        fn([net.blocks[1], net.head], **mesh_kw)
        fn(net, **mesh_kw)
        return net

    results = []
    for net in (build(fully_shard), build(torch_fsdp.fully_shard, mesh=torch_mesh())):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            loss = chunked_loss(net, batch(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().clone())
        results.append((losses, full_state(net)))
    assert_bitwise((results[0][0], results[1][0]), "chunked loss: losses")
    assert_bitwise((results[0][1], results[1][1]), "chunked loss")

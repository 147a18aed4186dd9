"""TransformerEngine-style fused weight-gradient accumulation through ``main_grad``, emulated on CPU.

``WgradLinear`` does what TE's ``Linear(fuse_wgrad_accumulation=True)`` does in backward: it adds
the weight gradient into ``weight.main_grad`` itself (read through ``get_main_grad()`` when the
parameter has ``__fsdp_param__``, as TE does for Megatron-FSDP), sets
``weight.grad_added_to_main_grad`` and returns a dummy weight gradient (zeros with
``zero_out_wgrad``, else garbage: NaN here) only if that attribute exists, else ``None``.
Models built from it must train exactly like the same model built from plain autograd ops,
under every strategy, including an embedding weight tied to a fused output layer
(``zero_out_wgrad``) and a unit called twice per forward; and like DDP over the plain model.
With ``overwrite`` the kernel writes the gradient instead of adding it, as Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` does for Megatron-FSDP parameters
(``torch.matmul(..., out=weight.main_grad)`` after ``get_main_grad()``): micro-batches
accumulated without a reduction must still add up.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import fully_shard
from tests.distributed.harness import check
from tests.models import VOCAB, local_batch

SUITE = "te_wgrad"
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
DIM = 13


class FusedWgradLinearFn(torch.autograd.Function):
    """``x @ weight.T`` whose backward accumulates the weight gradient into ``main_grad`` (TE's fused wgrad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, read_main_grad_in_forward: bool,
                overwrite: bool = False) -> torch.Tensor:
        ctx.weight = weight  # the Parameter object itself: its attributes are read and set in backward
        ctx.overwrite = overwrite
        if read_main_grad_in_forward:  # TE versions that take main_grad in forward
            main_grad = weight.get_main_grad() if getattr(weight, "__fsdp_param__", False) else weight.main_grad
            ctx.main_grad_func = lambda: main_grad
        elif getattr(weight, "__fsdp_param__", False):
            ctx.main_grad_func = weight.get_main_grad
        else:
            ctx.main_grad_func = lambda: weight.main_grad
        ctx.save_for_backward(x, weight)
        return x.mm(weight.t())

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight_data = ctx.saved_tensors
        weight = ctx.weight
        grad_x = grad_out.mm(weight_data)
        if ctx.overwrite:
            torch.matmul(grad_out.t(), x, out=ctx.main_grad_func())
        else:
            ctx.main_grad_func().add_(grad_out.t().mm(x))
        if not hasattr(weight, "grad_added_to_main_grad"):
            return grad_x, None, None, None  # no AccumulateGrad runs for the weight: no hook fires
        weight.grad_added_to_main_grad = True
        if getattr(weight, "zero_out_wgrad", False):
            dummy = torch.zeros_like(weight_data)
        else:  # TE returns torch.empty: anything added from it is a bug, so make it loud
            dummy = torch.full_like(weight_data, float("nan"))
        return grad_x, dummy, None, None


def linear(x: torch.Tensor, weight: nn.Parameter, fused: bool, read_in_forward: bool,
           overwrite: bool = False) -> torch.Tensor:
    if fused:
        return FusedWgradLinearFn.apply(x, weight, read_in_forward, overwrite)
    return x.mm(weight.t())


class Layer(nn.Module):
    def __init__(self, fused: bool, read_in_forward: bool, overwrite: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)  # plain autograd: its .grad goes through the hook
        self.fused, self.read_in_forward, self.overwrite = fused, read_in_forward, overwrite

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(linear(x, self.weight, self.fused, self.read_in_forward, self.overwrite) + self.bias)


class TiedLM(nn.Module):
    """Embedding tied to a (fused) output layer, as Megatron's GPT with shared embeddings; layers[0] runs
    twice unless the kernel overwrites (Megatron-LM never calls a layer twice: a second write would win)."""

    def __init__(self, fused: bool, read_in_forward: bool = False, overwrite: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight.zero_out_wgrad = True  # what megatron-core sets on the shared weight
        self.layers = nn.ModuleList([Layer(fused, read_in_forward, overwrite) for _ in range(2)])
        self.fused, self.read_in_forward, self.overwrite = fused, read_in_forward, overwrite

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).reshape(-1, DIM)
        for layer in self.layers:
            x = layer(x)
        if not self.overwrite:
            x = self.layers[0](x)  # one unit twice: its fused wgrads add up in main_grad
        return linear(x, self.embed.weight, self.fused, self.read_in_forward, self.overwrite)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))


def build(fused: bool, read_in_forward: bool = False, overwrite: bool = False) -> TiedLM:
    torch.manual_seed(0)
    return TiedLM(fused, read_in_forward, overwrite)


def shard(model: TiedLM, strategy: str) -> TiedLM:
    for layer in model.layers:
        fully_shard(layer, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    return model


def train(model: nn.Module, steps: int, backwards_per_step: int = 1, no_sync: bool = False) -> list[torch.Tensor]:
    """SGD with momentum; ``backwards_per_step`` > 1 accumulates: each backward reduced and added into
    .grad, or with ``no_sync`` the gradients kept unreduced until the last micro-batch's backward
    (``set_requires_gradient_sync``, Megatron's ``no_sync``)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        for micro in range(backwards_per_step):
            if no_sync:
                model.set_requires_gradient_sync(micro == backwards_per_step - 1)
            lm_loss(model, local_batch(step * backwards_per_step + micro, rank, n)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str, **tolerance: float) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all(), f"{what}: parameter {i} is not finite (a dummy gradient was added)"
        if tolerance:
            torch.testing.assert_close(a, b, msg=f"{what}: parameter {i}", **tolerance)
        else:
            assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"


@check(SUITE, world_sizes=(2,), params={"strategy": STRATEGIES, "read_in_forward": [False, True]})
def fused_wgrad_trains_like_plain_autograd(strategy: str, read_in_forward: bool) -> None:
    """Bitwise: the fused model equals the plain one, both under the engine, one and two backwards per step."""
    for backwards in (1, 2):
        plain = train(shard(build(fused=False), strategy), steps=3, backwards_per_step=backwards)
        fused = train(shard(build(fused=True, read_in_forward=read_in_forward), strategy), steps=3,
                      backwards_per_step=backwards)
        assert_same(fused, plain, f"{strategy}, {backwards} backward(s) per step")


@check(SUITE, world_sizes=(2,), params={"strategy": STRATEGIES, "read_in_forward": [False, True]})
def overwriting_wgrad_accumulates_across_unreduced_microbatches(strategy: str, read_in_forward: bool) -> None:
    """Megatron-LM's kernel writes main_grad (``out=``) each backward; three micro-batches kept unreduced
    (``set_requires_gradient_sync(False)``) and one reduced must still sum all four: bitwise the plain model."""
    for no_sync in (False, True):
        plain = train(shard(build(fused=False, overwrite=True), strategy), steps=2, backwards_per_step=4,
                      no_sync=no_sync)
        fused = train(shard(build(fused=True, read_in_forward=read_in_forward, overwrite=True), strategy), steps=2,
                      backwards_per_step=4, no_sync=no_sync)
        assert_same(fused, plain, f"{strategy}, overwriting kernel, no_sync={no_sync}")


@check(SUITE, world_sizes=(2,), params={"strategy": STRATEGIES})
def fused_wgrad_trains_like_ddp(strategy: str) -> None:
    """Against DDP over the plain model (fp32, 2 ranks: same division and SUM as DDP): rtol 1e-6."""
    reference = build(fused=False)
    ddp = train(DDP(copy.deepcopy(reference)), steps=3)
    fused = train(shard(build(fused=True), strategy), steps=3)
    assert_same(fused, ddp, f"{strategy} vs DDP", rtol=1e-6, atol=1e-7)


@check(SUITE, world_sizes=(2,))
def te_attributes_on_the_engine_parameters() -> None:
    """What TE and Megatron-LM look for: flags on the compute parameters, main_grad on the sharded ones."""
    model = shard(build(fused=True), "optim_grads_params")
    seen: dict[str, tuple] = {}

    def record(module: nn.Module, _args) -> None:
        w = module.weight
        seen.setdefault("flags", (w.grad_added_to_main_grad, getattr(w, "__fsdp_param__", False),
                                  callable(getattr(w, "get_main_grad", None))))

    model.layers[1].register_forward_pre_hook(record)
    rank, n = dist.get_rank(), dist.get_world_size()
    lm_loss(model, local_batch(0, rank, n)).backward()
    assert seen["flags"] == (False, True, True), seen
    shared = model.embed.weight
    assert shared.zero_out_wgrad is True  # carried from the original parameter
    for name, p in model.named_parameters():
        assert p.main_grad is p.grad, f"{name}: main_grad is not the reduced .grad"
    unit = model.fsdp_unit
    for group in unit.groups:  # consumed by the hook, ready for the next backward
        assert not any(q.grad_added_to_main_grad for q in group.unsharded_params)
    for p in model.parameters():
        p.grad = None
    for m in (model, *model.layers):
        for group in m.fsdp_unit.groups:
            group.discard_unreduced_grads()
    assert not any(hasattr(p, "main_grad") for p in model.parameters()), "main_grad outlived .grad"
    frozen = shard(build(fused=True), "optim_grads_params")
    frozen.layers[0].bias.requires_grad_(False)
    frozen.layers[0].fsdp_unit.groups[0].check_unchanged()  # follows requires_grad, as a forward does
    group = frozen.layers[0].fsdp_unit.groups[0]
    index = [r.fqn for r in group.refs].index("bias")
    try:
        group.unsharded_params[index].get_main_grad()
    except RuntimeError as e:
        assert "'bias'" in str(e) and "does not require grad" in str(e), e
    else:
        raise AssertionError("get_main_grad() of a frozen parameter gave a buffer")

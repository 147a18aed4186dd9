"""The gradient path users drive (docs/design.md, "Gradients"): accumulation without a reduction
over several micro-batches combined with unused, frozen and unfrozen parameters, mixed precision,
CPU offload and HSDP; second backwards, recomputation and ``torch.autograd.grad``; Megatron's
``scale_gradients``/``zero_grad_buffer`` mid-accumulation; hooks of the user's.

Each check compares the reduced ``.grad`` with a single-process replica that runs every rank's
micro-batches with plain autograd (so ``.grad`` accumulates as PyTorch's does), divided by the
number of ranks. The replica sums in another order than the reduction: ``RTOL``/``ATOL`` below,
unless a check says it is bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from megatron_fsdp import MegatronFSDP, MixedPrecisionPolicy, fully_shard
from tests.distributed.harness import check, device_type
from tests.distributed.shards import assert_close_sharded, raise_if_any_rank, sharded_mismatches
from tests.models import Net, global_batch, loss_fn

SUITE = "grad_path"
K = 3  # micro-batches per step
RTOL, ATOL = 1e-5, 1e-6  # fp32, the replica's summation order differs from the reduction's


class Skippy(Net):
    """``Net`` whose blocks can be skipped (unused parameters) or recomputed in backward."""

    skip: tuple[int, ...] = ()
    recompute: str | None = None  # None, "reentrant" or "non_reentrant"

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is None:
            return block(x)
        return checkpoint(block, x, use_reentrant=self.recompute == "reentrant")

    def forward(self, tokens: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens) + self.tiny
        if noise is not None:  # what a torch.autograd.grad metric differentiates by
            x = x + noise
        x = self.frozen(x)
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = self.run_block(block, x)
        x = self.run_block(self.blocks[0], x)  # block 0 twice: its hook fires twice under reentrant recompute
        return self.head(x)


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def configs() -> Iterator[tuple[str, dict]]:
    """(label, fully_shard kwargs): ZeRO-1/2/3, no_shard, CPU offload, and HSDP (2 x n/2) at 4 ranks."""
    _, n = world()
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        yield strategy, dict(sharding_strategy=strategy)
    yield "offload", dict(offload_policy=CPUOffloadPolicy())
    if n == 4:
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        yield "hsdp", dict(mesh=mesh)


def shard(model: Skippy, **kwargs) -> Skippy:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def micro_batches(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    _, n = world()
    return global_batch(step, n, per_rank=2 * K).chunk(n)[rank].chunk(K)


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_grads_match(model: nn.Module, replica: nn.Module, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every .grad equals the replica's within (rtol, atol), compared shard by shard (tests/distributed/shards.py)."""
    triples, unused = [], []
    for (name, p), q in zip(model.named_parameters(), replica.parameters()):
        got, want = p.grad, q.grad
        if want is None:  # a unit reduces zeros for its parameters without a gradient (an unused one's)
            if got is not None:
                unused.append((f"{what} {name}", got, torch.zeros(got.shape, dtype=got.dtype, device=got.device)))
            continue
        assert got is not None, f"{what} {name}: .grad is None, the replica's is set"
        triples.append((f"{what} {name}", got, want))
    raise_if_any_rank(sharded_mismatches(unused, _all_zero) + sharded_mismatches(
        triples, lambda a, e: torch.testing.assert_close(a, e, rtol=rtol, atol=atol)))


def _all_zero(got: torch.Tensor, _zeros: torch.Tensor) -> None:
    assert not got.any(), ".grad is set (not zeros), the replica's is None"


def replica_grads(replica: nn.Module, step: int, micro: Callable[[nn.Module, int, torch.Tensor], None]) -> None:
    """Every rank's micro-batches on ``replica`` with plain autograd, then ``.grad /= n`` (the mean)."""
    _, n = world()
    for rank in range(n):
        for k, batch in enumerate(micro_batches(step, rank)):
            micro(replica, k, batch)
    with torch.no_grad():
        for p in replica.parameters():
            if p.grad is not None:
                p.grad.div_(n)


def accumulate(model: nn.Module, step: int, micro: Callable[[nn.Module, int, torch.Tensor], None]) -> None:
    """K micro-batches, the first K-1 with ``set_requires_gradient_sync(False)``."""
    rank, _ = world()
    for k, batch in enumerate(micro_batches(step, rank)):
        model.set_requires_gradient_sync(k == K - 1)
        micro(model, k, batch)


def accumulated_like_the_replica(
    micro: Callable[[nn.Module, int, torch.Tensor], None],
) -> Iterator[tuple[str, nn.Module]]:
    """For each configuration: one no_sync accumulation of ``micro`` (step 0), its gradients checked against
    the replica's; yields the label and the model for any further check."""
    torch.manual_seed(0)
    base = Skippy()
    replica = copy.deepcopy(base)
    replica_grads(replica, 0, micro)
    for label, kwargs in configs():
        model = shard(copy.deepcopy(base), **kwargs)
        accumulate(model, 0, micro)
        assert_grads_match(model, replica, label)
        yield label, model


def unused_and_frozen(model: nn.Module, k: int, batch: torch.Tensor) -> None:
    """Block 2 unused in micro-batch 0; block 1's up weight frozen in micro-batch 1 only; block 2's
    down weight trained in micro-batch 0 only; the frozen layer trained in micro-batch 2 only."""
    model.skip = (2,) if k == 0 else ()
    model.blocks[1].up.weight.requires_grad_(k != 1)
    model.blocks[2].up.weight.requires_grad_(k == 0)
    model.frozen.weight.requires_grad_(k == 2)
    (loss_fn(model, batch) / K).backward()
    model.skip = ()


@check(SUITE)
def no_sync_with_unused_and_frozen_parameters_matches_plain_accumulation() -> None:
    """A parameter unused or frozen in some micro-batches keeps what the others accumulated (as .grad
    does in plain PyTorch), also when frozen at the reducing one; one trained only in the last gets
    that one's gradient. Between micro-batches a ZeRO-1/2 or no_shard module shows the compute-time
    parameter: freezing it there counts (it was undone at the next forward)."""
    for label, model in accumulated_like_the_replica(unused_and_frozen):
        assert not model.blocks[2].up.weight.requires_grad and model.frozen.weight.requires_grad, label


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # fp32 main weights and main gradients
# Megatron-style calls between micro-batches: ("micro", k) a backward, ("scale", f) scale_gradients,
# ("zero",) zero_grad_buffer. "stash": scaled while one bf16 gradient is stashed (autograd's tensor);
# "sum": scaled after two were summed; "zero": the buffer dropped after the first micro-batch.
PLANS = {
    "stash": (("micro", 0), ("scale", 1 / 3), ("micro", 1), ("micro", 2)),
    "sum": (("micro", 0), ("micro", 1), ("scale", 0.7), ("micro", 2)),
    "zero": (("micro", 0), ("zero",), ("micro", 1), ("scale", 1 / 3), ("micro", 2)),
}


def bf16_rank_sum(base: nn.Module, rank: int, plan: tuple) -> list[torch.Tensor | None]:
    """One rank's gradients as fp32 main gradients accumulate them: each micro-batch's bf16 gradient
    widened to fp32 and added, scaling applied in fp32 (the semantics of a zeroed fp32 buffer)."""
    compute = copy.deepcopy(base).to(torch.bfloat16)
    total: list[torch.Tensor | None] = [None] * len(list(compute.parameters()))
    for op, *arg in plan:
        if op == "zero":
            total = [None] * len(total)
        elif op == "scale":
            total = [None if t is None else t * arg[0] for t in total]
        else:
            compute.zero_grad()
            (loss_fn(compute, micro_batches(0, rank)[arg[0]]) / K).backward()
            for i, p in enumerate(compute.parameters()):
                if p.grad is not None:
                    total[i] = p.grad.float() if total[i] is None else total[i] + p.grad.float()
    return total


@check(SUITE, params={"plan": tuple(PLANS)})
def megatron_calls_mid_accumulation_keep_fp32_main_grad_semantics(plan: str) -> None:
    """bf16 compute, fp32 main gradients, Megatron's loop (micro-batches under ``no_sync`` but the last,
    then ``finish_grad_sync``): scale_gradients and zero_grad_buffer between micro-batches give what a
    zeroed fp32 buffer gave, although the stash holds bf16 gradients until the reduction. Bitwise at
    2 ranks (one reduction of each rank's sum, a + b either way round); at 4 the reduction's order
    differs: RTOL/ATOL."""
    rank, n = world()
    torch.manual_seed(0)
    base = Skippy()
    sums = [bf16_rank_sum(base, r, PLANS[plan]) for r in range(n)]
    last = max(arg[0] for op, *arg in PLANS[plan] if op == "micro")
    for label, kwargs in configs():
        model = MegatronFSDP(shard(copy.deepcopy(base), mp_policy=BF16, **kwargs))
        for op, *arg in PLANS[plan]:
            if op == "zero":
                model.zero_grad_buffer()
            elif op == "scale":
                model.scale_gradients(arg[0])
            elif arg[0] == last:
                (loss_fn(model, micro_batches(0, rank)[arg[0]]) / K).backward()
            else:
                with model.no_sync():
                    (loss_fn(model, micro_batches(0, rank)[arg[0]]) / K).backward()
        model.finish_grad_sync()
        for i, (name, p) in enumerate(model.module.named_parameters()):
            if sums[0][i] is None:
                continue
            want = sum(s[i] / n for s in sums)
            got = full(p.grad)
            assert got is not None and got.dtype == torch.float32, f"{label} {name}: {got}"
            if n == 2:
                assert torch.equal(got, want), (
                    f"{label} {name}: {int((got != want).sum())} of {want.numel()} differ, by up to "
                    f"{(got - want).abs().max().item() / want.abs().max().item():.3g} of the largest")
            else:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, w=f"{label} {name}": f"{w}: {m}")


def logits_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def retain_graph_twice(model: nn.Module, k: int, batch: torch.Tensor) -> None:
    loss = loss_fn(model, batch) / K
    loss.backward(retain_graph=True)
    (loss * 0.5).backward()


def gradient_metric_then_backward(model: nn.Module, k: int, batch: torch.Tensor) -> None:
    """torch.autograd.grad for a metric (graph retained), then the normal backward of the same graph."""
    noise = torch.zeros(*batch[:, :-1].shape, model.embed.embedding_dim, requires_grad=True)
    loss = logits_loss(model(batch[:, :-1], noise), batch)
    torch.autograd.grad(loss, noise, retain_graph=True)
    (loss / K).backward()


def recomputed(mode: str) -> Callable[[nn.Module, int, torch.Tensor], None]:
    def micro(model: nn.Module, k: int, batch: torch.Tensor) -> None:
        model.recompute = mode
        (loss_fn(model, batch) / K).backward()
        model.recompute = None
    return micro


AUTOGRAD_CASES = {
    "retain_graph_twice": retain_graph_twice,
    "gradient_metric_then_backward": gradient_metric_then_backward,
    "reentrant_checkpoint": recomputed("reentrant"),
    "non_reentrant_checkpoint": recomputed("non_reentrant"),
}


@check(SUITE, params={"case": tuple(AUTOGRAD_CASES)})
def autograd_patterns_under_no_sync_accumulation(case: str) -> None:
    """A second backward of one graph, torch.autograd.grad (no .grad accumulation) before the
    backward, activation checkpointing with a unit run twice (its hook fires twice per backward
    when reentrant), each in every micro-batch of a no_sync accumulation: what plain autograd
    accumulates in .grad."""
    for _ in accumulated_like_the_replica(AUTOGRAD_CASES[case]):
        pass  # each configuration is checked as it is yielded



def plain_micro(model: nn.Module, k: int, batch: torch.Tensor) -> None:
    (loss_fn(model, batch) / K).backward()


def train_with_optimizer_in_backward(model: nn.Module, steps: int, label: str) -> dict[str, int]:
    """FSDP2's recipe: one SGD per sharded parameter, stepped by its post-accumulate-grad hook.
    Returns how often each parameter's hook ran."""
    calls: dict[str, int] = {}
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters() if p.requires_grad}

    def step_in_backward(param: nn.Parameter, name: str) -> None:
        assert param.grad is not None, f"{label} {name}: hook ran without .grad"
        calls[name] = calls.get(name, 0) + 1
        optimizers[param].step()
        optimizers[param].zero_grad()

    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p, name=name: step_in_backward(p, name))
    for step in range(steps):
        accumulate(model, step, plain_micro)
    return calls


@check(SUITE)
def optimizer_in_backward_post_accumulate_hooks_on_sharded_parameters() -> None:
    """FSDP2's optimizer-in-backward: a post-accumulate-grad hook registered on each sharded parameter
    runs once its reduced .grad is installed (once per no_sync accumulation), sees that gradient,
    steps and drops it; two steps match the replica stepped after its backward."""
    torch.manual_seed(0)
    base = Skippy()
    replica = copy.deepcopy(base)
    replica_opt = torch.optim.SGD(replica.parameters(), lr=0.1)
    for step in range(2):
        replica_grads(replica, step, plain_micro)
        replica_opt.step()
        replica_opt.zero_grad()
    for label, kwargs in configs():
        model = shard(copy.deepcopy(base), **kwargs)
        calls = train_with_optimizer_in_backward(model, 2, label)
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        assert calls == dict.fromkeys(trainable, 2), f"{label}: hook calls {calls}, want 2 for each of {trainable}"
        assert_close_sharded([(name, p, q) for (name, p), q in zip(model.named_parameters(), replica.parameters())],
                             label, rtol=RTOL, atol=ATOL)


@check(SUITE)
def zero_grad_keeping_tensors_and_clipping_after_accumulation() -> None:
    """zero_grad(set_to_none=False) between steps (the reduced gradient is added into the kept zeros),
    clip_grad_norm_ after the last micro-batch: the same total norm and weights as the replica.
    No weight decay: the root unit installs zeros for its unused parameters (the probe), where the
    replica's .grad stays None and AdamW would skip it."""
    torch.manual_seed(0)
    base = Skippy()
    replica = copy.deepcopy(base)
    replica_opt = torch.optim.AdamW(replica.parameters(), lr=1e-2, weight_decay=0.0)
    want_norms, want_grads = [], []
    for step in range(2):
        replica_grads(replica, step, unused_and_frozen)
        snapshot = copy.deepcopy(replica)  # deepcopy does not copy .grad
        for q, r in zip(snapshot.parameters(), replica.parameters()):
            q.grad = None if r.grad is None else r.grad.clone()
        want_grads.append(snapshot)
        want_norms.append(torch.nn.utils.clip_grad_norm_(replica.parameters(), 0.05))
        replica_opt.step()
        replica_opt.zero_grad(set_to_none=False)
    for label, kwargs in configs():
        model = shard(copy.deepcopy(base), **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for step in range(2):
            accumulate(model, step, unused_and_frozen)
            assert_grads_match(model, want_grads[step], f"{label} step {step}")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.testing.assert_close(full(norm), want_norms[step], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, w=f"{label} step {step}": f"{w} norm: {m}")
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert_close_sharded([(name, p, q) for (name, p), q in zip(model.named_parameters(), replica.parameters())],
                             label, rtol=RTOL, atol=ATOL)

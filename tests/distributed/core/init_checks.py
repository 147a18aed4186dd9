"""Meta-device initialisation (one spawned group per world size)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from megatron_fsdp import fsdp_no_shard, fully_shard, materialize_meta
from tests.distributed.core.engine_checks import expect_error, world
from tests.distributed.harness import check, device_type
from tests.models import Block, Net, local_batch, loss_fn

SUITE = "init"


class MetaNet(nn.Module):
    """Every parameter is initialised by its module's reset_parameters (unlike models.Net's ``tiny``)."""

    def __init__(self, layers: int = 3, vocab: int = 17, dim: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: nn.Module, blocks) -> nn.Module:
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


@check(SUITE)
def meta_init_equals_eager_init_bitwise() -> None:
    rank, n = world()
    torch.manual_seed(7)
    eager = MetaNet()
    with torch.device("meta"):
        model = MetaNet()
    fsdp_no_shard(model.blocks[1].up.weight)  # a single marked parameter
    shard(model, model.blocks)
    # Ranks disagree on the random state on purpose: rank 0's stream wins (broadcast).
    torch.manual_seed(7 if rank == 0 else 7 + rank)
    materialize_meta(model)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    assert model.blocks[1].up.weight.placements == (Replicate(),), "no-shard mark lost in materialisation"
    # and it trains exactly like the eager-built sharded model
    reference = shard(eager, eager.blocks)
    for m in (model, reference):
        loss_fn(m, local_batch(0, rank, n)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-6, atol=1e-7, msg=name)


@check(SUITE, world_sizes=(2,))
def meta_init_runs_before_first_forward_and_names_missing_init() -> None:
    rank, n = world()
    with torch.device("meta"):
        model = Net()
    shard(model, [*model.blocks, model.probe])
    try:
        loss_fn(model, local_batch(0, rank, n))
    except ValueError as e:
        assert "['tiny']" in str(e) and "init_fn" in str(e), str(e)
    else:
        raise AssertionError("a parameter without an initialiser was accepted")

    def init(module: nn.Module) -> None:
        if isinstance(module, Net):
            nn.init.normal_(module.tiny, std=0.1)
        else:
            module.reset_parameters()

    materialize_meta(model, init_fn=init)
    loss = loss_fn(model, local_batch(0, rank, n))  # lazy init finds nothing left to do
    loss.backward()
    assert torch.isfinite(loss) and model.tiny.full_tensor().abs().sum() > 0


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@check(SUITE, world_sizes=(2,))
def meta_init_never_holds_the_whole_model() -> None:
    if not _reset_peak_rss():
        print("skipping peak-RSS check: /proc/self/clear_refs not writable")
        return
    layers, dim = 32, 1024
    full_bytes = layers * (dim * dim + dim) * 4  # 128 MiB
    dist.barrier()
    _reset_peak_rss()
    before = _peak_rss_bytes()
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    shard(model, list(model))
    materialize_meta(model)
    growth = _peak_rss_bytes() - before
    # this rank's shards plus a quarter of the model for one layer in flight and allocator slack;
    # materialising whole would need the full model on top of the shards
    cap = full_bytes / dist.get_world_size() + 0.25 * full_bytes
    if dist.get_rank() == 0:
        print(f"meta-init peak RSS growth {growth / 2**20:.1f} MiB for a {full_bytes / 2**20:.0f} MiB model "
              f"on {dist.get_world_size()} ranks (cap {cap / 2**20:.0f} MiB), pid {os.getpid()}")
    assert growth < cap, (growth, cap)


class Scale(nn.Module):
    """A parameter-free module with a buffer its reset_parameters fills."""

    def __init__(self, dim: int, has_reset: bool = True) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(dim))
        if has_reset:
            self.reset_parameters = lambda: nn.init.constant_(self.scale, 0.5)
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@check(SUITE, world_sizes=(2,))
def meta_init_of_buffers() -> None:
    def build(has_reset: bool = True) -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), Scale(6, has_reset), nn.Linear(6, 2))

    torch.manual_seed(3)
    eager = build()
    with torch.device("meta"):
        model = build()
    fully_shard(model[0])
    fully_shard(model)
    torch.manual_seed(3)
    materialize_meta(model)
    for (name, b), e in zip(model.named_buffers(), eager.buffers()):
        assert b.device.type == device_type() and torch.equal(b, e), name
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    with torch.device("meta"):
        broken = build(has_reset=False)
    fully_shard(broken)
    expect_error(ValueError, "meta-device buffers ['scale'] of Scale", materialize_meta, broken)


class Bare(nn.Module):
    """A module whose class has no ``reset_parameters`` (as megatron-core's tensor-parallel layers): its caller
    binds one to the instance."""

    def __init__(self, rows: int = 5, cols: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.bias = nn.Parameter(torch.empty(rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


@check(SUITE, world_sizes=(2,))
def meta_init_runs_an_instance_reset_and_names_what_it_left_unwritten() -> None:
    """An instance's own ``reset_parameters`` (bound per module, its class having none) initialises it; one that
    leaves a parameter, or part of it, unwritten (or rebinds ``.data``) stops materialisation naming it."""

    def full_init(module: Bare) -> None:
        nn.init.normal_(module.weight)
        module.bias.zero_()

    def build(reset) -> nn.Sequential:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(3, 3), Bare())
        model[1].reset_parameters = lambda: reset(model[1])
        fully_shard(model[1])
        return fully_shard(model)

    model = build(full_init)
    torch.manual_seed(5)
    materialize_meta(model)
    torch.manual_seed(5)
    eager = nn.Sequential(nn.Linear(3, 3), Bare())
    with torch.no_grad():
        full_init(eager[1])
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    for reset, what in ((lambda m: nn.init.normal_(m.weight), "'bias'"),  # the bias skipped
                        (lambda m: (nn.init.normal_(m.weight[:2]), m.bias.zero_()), "'weight'"),  # part of it
                        (lambda m: (setattr(m.weight, "data", torch.randn(5, 3)), m.bias.zero_()), "'weight'")):
        expect_error(ValueError, (what, "Bare", "unwritten"), materialize_meta, build(reset))

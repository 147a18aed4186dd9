"""One real rank of an N-rank job: what it holds, moves and costs, under torch's fake process group.

Run:

    python benchmarks/simulate_scale.py --model llama3-8b --worlds 8 64 256 1024
    python benchmarks/simulate_scale.py --model llama3-70b --worlds 1024 4096 --layers 1
    python benchmarks/simulate_scale.py --model llama3-8b --worlds 1024 --hsdp 8 --fwd-bwd --vocab 32000

The fake process group (``dist.init_process_group("fake")``) makes every
collective return at once without touching its buffers, so one process is rank
``--rank`` of ``N`` and every rank-count-dependent decision of the engine (the
layout, the RaggedShard sizes, the buffers, the schedule's control rounds) runs
for real. The model is built on the meta device with the real shapes
(``megatron_fsdp.plan.models``), each decoder layer is ``fully_shard``-ed, then
the root; only this rank's shards are allocated. ``--layers`` decoder layers are
built (default 2): every layer lays out identically, so per-layer figures are
exact and whole-model figures are scaled to the model's layer count from them.
``--fwd-bwd`` also runs one forward and backward of ``--seq`` tokens (numbers are
garbage: the fake all-gather leaves the gathered buffers unwritten; only bytes
and shapes count). It needs the root's gathered weights and gradient buffer in
host memory, so use ``--vocab`` to shrink the embedding for it on a small host.

Every figure is checked against ``megatron_fsdp.plan`` (the analytic per-rank
memory from the same layout arithmetic); a mismatch raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_fsdp import fully_shard
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.meta_init import materialize_meta
from megatron_fsdp.plan import LlamaConfig, MLPConfig, fsdp2_padded_numel, model_named, plan_rank
from megatron_fsdp.plan.estimate import RankPlan
from megatron_fsdp.sharding.strategy import STRATEGY_NAMES

GIB = 1024**3
MIB = 1024**2


# -- models of real shape ------------------------------------------------------
class DecoderLayer(nn.Module):
    """A Llama decoder layer: RMSNorm, GQA attention (no RoPE: it holds no parameters), SwiGLU MLP."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        h, kv = c.hidden, c.kv_heads * c.head_dim
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        self.input_layernorm = nn.RMSNorm(h)
        self.self_attn = nn.Module()
        for name, out in (("q_proj", h), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
            setattr(self.self_attn, name, nn.Linear(h if name != "o_proj" else h, out, bias=False))
        self.post_attention_layernorm = nn.RMSNorm(h)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.ffn, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.ffn, bias=False)
        self.mlp.down_proj = nn.Linear(c.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = self.self_attn
        y = self.input_layernorm(x)
        q = a.q_proj(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + a.o_proj(o)
        y = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(layers))
        self.norm = nn.RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class MLP(nn.Module):
    def __init__(self, c: MLPConfig, layers: int) -> None:
        super().__init__()
        self.hidden = c.hidden
        self.layers = nn.ModuleList(nn.Linear(c.hidden, c.hidden) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.ones(*tokens.shape, self.hidden)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build(config: LlamaConfig | MLPConfig, layers: int) -> nn.Module:
    """The model on the meta device; its parameter shapes are asserted equal to the plan's."""
    with torch.device("meta"):
        model = Llama(config, layers) if isinstance(config, LlamaConfig) else MLP(config, layers)
    expected = [s for _, s in config.layer_params()]
    for layer in model.layers:
        got = [tuple(p.shape) for p in layer.parameters()]
        assert got == expected, f"module shapes {got} differ from the plan's {expected}"
    return model


# -- one simulated rank ----------------------------------------------------------
@dataclasses.dataclass
class Measured:
    setup_s: float
    setup_rss_mib: float
    units: list  # (name, shard_numel, total_numel, param_numel, local_param_numel) of one unit per kind
    step_bytes: dict[str, int] | None
    step_s: float | None


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _unit_figures(module: nn.Module) -> tuple[int, int, int, int]:
    """(shard, unsharded, parameter, this rank's parameter) elements over the unit's flat buffers."""
    (unit,) = [u for u in units_of(module) if u.module is module]
    layouts = [g.layout for g in unit.groups]
    local = sum(p.to_local().numel() for g in unit.groups for p in g.sharded_params)
    return (sum(x.shard_numel for x in layouts), sum(x.total_numel for x in layouts),
            sum(x.param_numel for x in layouts), local)


def simulate(config, world: int, strategy: str, layers: int, rank: int, outer: int, outer_optim: bool,
             seq: int | None) -> Measured:
    """Rank ``rank`` of ``world``: shard the model, optionally run forward+backward, measure."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if outer > 1:
            mesh = init_device_mesh("cpu", (outer, world // outer), mesh_dim_names=("dp_outer", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        kwargs = dict(mesh=mesh, sharding_strategy=strategy)
        if outer > 1:
            kwargs.update(dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                          outer_sharding_strategy="optim" if outer_optim else "no_shard")
        model = build(config, layers)
        rss0, t0 = _rss_mib(), time.perf_counter()
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        setup_s, setup_rss = time.perf_counter() - t0, _rss_mib() - rss0
        figures = [("layer", *_unit_figures(model.layers[0]))]
        if isinstance(config, LlamaConfig):
            figures.append(("root", *_unit_figures(model)))
        step_bytes = step_s = None
        if seq is not None:
            materialize_meta(model)
            model.fsdp_comm_stats.reset()
            tokens = torch.zeros(1, seq, dtype=torch.long)
            t0 = time.perf_counter()
            model(tokens).float().sum().backward()
            step_s = time.perf_counter() - t0
            step_bytes = {k: v for k, v in model.fsdp_comm_stats.bytes.items() if k != "control"}
        return Measured(setup_s, setup_rss, figures, step_bytes, step_s)
    finally:
        dist.destroy_process_group()


def check(plan: RankPlan, measured: Measured) -> None:
    """Raise unless the engine's figures equal the plan's (the layout arithmetic both share)."""
    for (name, shard, total, param, local), u in zip(measured.units, plan.units):
        want = (u.shard_numel, u.total_numel, u.unit.numel, u.local_param_numel(plan.rank))
        if (shard, total, param, local) != want:
            raise AssertionError(f"{name}: engine (shard, total, params, local) {(shard, total, param, local)} "
                                 f"!= plan {want}")
    if measured.step_bytes is not None:
        want = plan.step_bytes()
        if measured.step_bytes != want:
            raise AssertionError(f"bytes per step: engine {measured.step_bytes} != plan {want}")


def warm_up() -> None:
    """First DTensor use imports torch._dynamo (seconds): pay it before any timing."""
    simulate(MLPConfig("warm", 8, 1), 2, "optim_grads_params", 1, 0, 1, False, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--strategies", nargs="+", default=["optim_grads_params"], choices=STRATEGY_NAMES)
    p.add_argument("--layers", type=int, default=2, help="decoder layers built (figures scale per layer)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--hsdp", type=int, default=1, help="dp_outer size (HSDP replicas)")
    p.add_argument("--outer-optim", action="store_true")
    p.add_argument("--fwd-bwd", action="store_true", help="also run one forward+backward")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (fwd/bwd on a small host)")
    args = p.parse_args(argv)
    config = model_named(args.model)
    if args.vocab is not None:
        config = dataclasses.replace(config, vocab=args.vocab)
    warm_up()
    print(f"# {config}; built with {args.layers} decoder layers, whole-model figures scaled to "
          f"{config.layers}; rank {args.rank}; fp32 weights, Adam state = 2 x local elements")
    head = (f"{'strategy':<19}{'N':>6}{'shard/layer':>12}{'buf':>4}{'x share':>8}{'FSDP2 x':>8}{'root x':>8}"
            f"{'params GiB':>11}{'grads GiB':>10}{'Adam GiB':>9}{'ZeRO GiB':>9}{'transient GiB':>14}"
            f"{'setup s/layer':>14}{'RSS MiB':>8}")
    print(head)
    for strategy in args.strategies:
        for world in args.worlds:
            m = simulate(config, world, strategy, args.layers, args.rank, args.hsdp, args.outer_optim,
                         args.seq if args.fwd_bwd else None)
            local = plan_rank(config.units(args.layers), world, strategy, outer=args.hsdp,
                              outer_optim=args.outer_optim, rank=args.rank)
            check(local, m)
            whole = plan_rank(config.units(), world, strategy, outer=args.hsdp, outer_optim=args.outer_optim,
                              rank=args.rank)
            layer = whole.units[0]
            fsdp2 = fsdp2_padded_numel(layer.unit.shapes, whole.pieces) / layer.unit.numel
            last = whole.units[-1]
            root = f"{last.total_numel / last.unit.numel:8.4f}" if last.unit.is_root else f"{'-':>8}"
            zero = whole.zero_main_params() / GIB
            print(f"{strategy:<19}{world:>6}{layer.shard_numel:>12,}{len(layer.layouts):>4}"
                  f"{layer.total_numel / layer.unit.numel:>8.4f}{fsdp2:>8.4f}{root}"
                  f"{whole.main_params / GIB:>11.3f}{whole.grads / GIB:>10.3f}{whole.optimizer_state / GIB:>9.3f}"
                  f"{zero:>9.3f}{whole.largest_transient / GIB:>14.3f}"
                  f"{m.setup_s / (args.layers + 1):>14.4f}{m.setup_rss_mib:>8.0f}")
            if m.step_bytes is not None:
                minimum = local.step_bytes(padded=False)
                parts = ", ".join(f"{k} {v / GIB:.3f} GiB ({v / minimum[k]:.4f}x ZeRO min)"
                                  for k, v in sorted(m.step_bytes.items()))
                print(f"{'':<25}fwd+bwd of {args.layers} layers + root, seq {args.seq}: {m.step_s:.1f} s; {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

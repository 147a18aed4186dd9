"""``python -m megatron_fsdp.plan``: will it fit? Per-rank memory of a model under a strategy."""

from __future__ import annotations

import argparse
import sys

from megatron_fsdp.plan.estimate import Precision, RankPlan, fsdp2_padded_numel, plan_rank
from megatron_fsdp.plan.models import MODELS, model_named
from megatron_fsdp.sharding.strategy import STRATEGY_NAMES

GIB = 1024**3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_fsdp.plan", description=__doc__)
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="model shape")
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--strategy", default="optim_grads_params", choices=STRATEGY_NAMES)
    p.add_argument("--outer", type=int, default=1, help="HSDP replicas (dp_outer); dp_shard = world / outer")
    p.add_argument("--outer-optim", action="store_true", help="HSDP outer_sharding_strategy='optim'")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16: bf16 compute, fp32 main")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    return p


def report(plan: RankPlan) -> str:
    """The per-rank table the CLI prints."""
    lines = [
        f"{plan.strategy.name} on {plan.world} ranks"
        + (f" ({plan.outer} x {plan.world // plan.outer} HSDP)" if plan.outer > 1 else "")
        + f", {plan.param_numel / 1e9:.2f}B parameters, main shards over {plan.pieces} ranks, rank {plan.rank}",
        f"{'per rank':<34}{'GiB':>10}{'ZeRO GiB':>10}{'ratio':>8}",
    ]
    rows = [
        ("main weights", plan.main_params, plan.zero_main_params()),
        ("gradients (until zero_grad)", plan.grads, plan.zero_grads()),
        ("Adam state", plan.optimizer_state, plan.zero_optimizer_state()),
    ]
    for name, ours, zero in rows:
        lines.append(f"{name:<34}{ours / GIB:>10.3f}{zero / GIB:>10.3f}{ours / zero:>8.3f}")
    if plan.compute_shards:
        lines.append(f"{'compute-dtype shards':<34}{plan.compute_shards / GIB:>10.3f}")
    lines.append(f"{'resident between steps':<34}{plan.resident / GIB:>10.3f}")
    lines.append(f"{'gathered weights in fwd/bwd':<34}{plan.gathered_weights / GIB:>10.3f}")
    lines.append(f"{'largest transient (unit + grads)':<34}{plan.largest_transient / GIB:>10.3f}")
    lines.append("")
    lines.append(f"{'unit':<16}{'count':>6}{'buffers':>8}{'padding':>14}{'%':>8}{'FSDP2 %':>9}")
    for u in plan.units:
        fsdp2 = fsdp2_padded_numel(u.unit.shapes, plan.pieces) - u.unit.numel
        lines.append(
            f"{u.unit.name:<16}{u.unit.count:>6}{len(u.layouts):>8}{u.padding_numel:>14,}"
            f"{100 * u.padding_fraction:>8.3f}"
            f"{100 * fsdp2 / u.unit.numel:>9.3f}"
        )
    padded, minimum = plan.step_bytes(), plan.step_bytes(padded=False)
    lines.append("")
    for kind in sorted(padded):
        lines.append(
            f"{kind + ' per step':<34}{padded[kind] / GIB:>10.3f}{minimum[kind] / GIB:>10.3f}"
            f"{padded[kind] / minimum[kind]:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        plan = plan_rank(
            model_named(args.model).units(args.layers),
            args.world,
            args.strategy,
            outer=args.outer,
            outer_optim=args.outer_optim,
            precision=Precision.named(args.precision),
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())

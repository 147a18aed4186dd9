"""HSDP across nodes: bytes per optimizer step inside a node and across nodes, from the cost model.

Run: ``python benchmarks/simulate_hsdp_traffic.py`` (seconds; no process group).

For a Llama-3 8B and 70B (``megatron_fsdp.plan.models``) at 128 and 1,024 ranks with 8 ranks
per node, HSDP shards inside a node (``dp_shard=8``) and replicates across nodes
(``dp_outer=world/8``), ZeRO-3, bf16 compute and fp32 gradient communication. Per optimizer
step of ``m`` micro-batches (1, 4, 16):

- inside a node: every micro-batch gathers each unit for forward and again for backward (the
  root once) and reduce-scatters its gradients;
- across nodes: the replicas' reduction of each rank's gradient shard, an all-reduce of
  the shard (replicating outer dimension), once per step when deferred to the last
  micro-batch, once per micro-batch otherwise.

Rows: **ours** (deferred: ``microbatch(..., is_last=False)``, issue 38) from the layout
arithmetic of ``megatron_fsdp.plan`` (padding included, as the engine lays out);
**ours before issue 38** (outer reduction per micro-batch); **FSDP2** with per-parameter
``Shard(0)`` padding (``fsdp2_padded_numel``), without ``set_requires_all_reduce(False)``
(all-reduce every micro-batch) and with it (once per step); **Megatron-FSDP's formula**: the
unpadded ZeRO minimum with the outer reduction once per step (Megatron-LM's
``microbatch(context, is_last=False)``/``sync_model_each_microbatch=False``). Bytes follow
``CommStats``' convention: the buffer each call moves (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor), per rank. Control rounds are left out.
A model, not a measurement: the per-micro-batch counts it assumes are the ones
``tests/distributed/sharding/hsdp_checks.py`` measures at 4 gloo ranks.
"""

from __future__ import annotations

from megatron_fsdp.plan.estimate import Precision, fsdp2_padded_numel, plan_rank
from megatron_fsdp.plan.models import model_named

NODE = 8
PRECISION = Precision.named("bf16")


def per_step(model: str, world: int, micro: int) -> dict[str, tuple[float, float]]:
    """(inside-node GB, across-node GB) per optimizer step for each implementation row."""
    units = model_named(model).units()
    outer = world // NODE
    plan = plan_rank(units, world, "optim_grads_params", outer=outer, precision=PRECISION)
    padded, ideal = plan.step_bytes(padded=True), plan.step_bytes(padded=False)
    p = PRECISION
    fsdp2_inner = fsdp2_outer = 0
    for u in units:
        full = fsdp2_padded_numel(u.shapes, NODE) * u.count
        gathers = 1 if u.is_root else 2
        fsdp2_inner += gathers * full * p.compute + full * p.grad
        fsdp2_outer += full // NODE * p.grad
    inner_ours = padded["all_gather"] + padded["reduce_scatter"]
    inner_ideal = ideal["all_gather"] + ideal["reduce_scatter"]
    gb = 1e9
    return {
        "ours (outer deferred)": (micro * inner_ours / gb, padded["all_reduce"] / gb),
        "ours before issue 38": (micro * inner_ours / gb, micro * padded["all_reduce"] / gb),
        "FSDP2": (micro * fsdp2_inner / gb, micro * fsdp2_outer / gb),
        "FSDP2 + set_requires_all_reduce(False)": (micro * fsdp2_inner / gb, fsdp2_outer / gb),
        "Megatron-FSDP formula (unpadded)": (micro * inner_ideal / gb, ideal["all_reduce"] / gb),
    }


def main() -> None:
    print("| model | ranks (nodes) | micro-batches | implementation | inside a node, GB/step | across nodes, GB/step |")
    print("|---|---|---|---|---|---|")
    for model in ("llama3-8b", "llama3-70b"):
        for world in (128, 1024):
            for micro in (1, 4, 16):
                for name, (inner, outer) in per_step(model, world, micro).items():
                    print(f"| {model} | {world} ({world // NODE}) | {micro} | {name} | {inner:.2f} | {outer:.3f} |")


if __name__ == "__main__":
    main()

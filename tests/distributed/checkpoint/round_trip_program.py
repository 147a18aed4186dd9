"""Issue 25's scenarios as a whole program per rank: DCP checkpoints moved between wrapped models, and more.

``python -m tests.distributed.checkpoint.round_trip_program ours,fsdp2,collectives,async_save DIR`` under
``torchrun --nproc-per-node 2`` (or ``run(rank, port, scenarios, dir)`` from a spawner) runs the
named scenarios in order, then exits (after ``destroy_process_group()`` unless ``--no-destroy``).
The round trips (``ours``, ``fsdp2``): a model
of ours (three ``Linear`` units and the root) has 1 added to its weights and is saved with
DCP; a second model (``ours``: another of ours; ``fsdp2``: PyTorch's FSDP2) loads it; both
full state dicts are compared; the second is doubled, saved, and loaded into a third model
of ours; full state dicts and a forward are compared again. ``collectives``: our collectives
on temporaries. ``async_save``: a background checkpoint save never waited for. Then
``destroy_process_group()`` (unless not asked for) and a normal interpreter exit. The models stay alive to the end,
so whatever they hold meets the teardown. Any mismatch raises; the caller checks every
rank's exit status (an abort at exit included).

Before the fix (2026-11-25, 2 gloo ranks): ``fsdp2`` failed 11 of 14 runs (collective
mismatches in ``get_model_state_dict(full_state_dict=True)``, DCP read-size assertions, one
abort at exit); ``ours`` aborted at exit in about 1 run in 10-30 (see the test).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from megatron_fsdp import fully_shard
from megatron_fsdp.comm.collectives import all_gather, all_reduce_max

FULL = StateDictOptions(full_state_dict=True)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5), nn.Linear(5, 3))
    shard = fully_shard if kind == "ours" else fsdp2_fully_shard
    for i in (0, 2, 3):
        shard(model[i])
    shard(model)
    return model


def load_into(model: nn.Module, path: str) -> None:
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)


def assert_same(x: nn.Module, y: nn.Module, what: str) -> None:
    fx, fy = get_model_state_dict(x, options=FULL), get_model_state_dict(y, options=FULL)
    assert fx.keys() == fy.keys(), what
    for key in fx:
        assert torch.equal(fx[key], fy[key]), f"{what}: {key} differs"


def round_trip(mode: str, directory: str) -> list[nn.Module]:
    a = build("ours")
    with torch.no_grad():
        for p in a.parameters():
            p.add_(1.0)
    dcp.save(get_model_state_dict(a), checkpoint_id=os.path.join(directory, "a"))
    b = build(mode)
    load_into(b, os.path.join(directory, "a"))
    assert_same(a, b, f"ours -> {mode}")
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(2.0)
    dcp.save(get_model_state_dict(b), checkpoint_id=os.path.join(directory, "b"))
    c = build("ours")
    load_into(c, os.path.join(directory, "b"))
    assert_same(b, c, f"{mode} -> ours")
    x = torch.randn(4, 7)
    assert torch.equal(b(x), c(x)), "forward after the round trip"
    return [a, b, c]


def collectives(directory: str) -> list[torch.Tensor]:
    """Our gloo collectives on temporaries (the all-gather's per-rank views, a control round).

    The exit race of ``megatron_fsdp/comm/lending.py`` in its barest form: without lending, a
    program doing only this and exiting aborted ("terminate called without an active
    exception") in 2-6 of 20 runs on the busy 2-core machine.
    """
    rank = dist.get_rank()
    group = dist.group.WORLD
    output = torch.zeros(4096)
    for step in range(20):
        all_gather(output, torch.full((2048,), float(rank + step)), group).wait()
        all_reduce_max(torch.tensor([step + rank]), group)
    expected = torch.cat([torch.full((2048,), float(r + 19)) for r in range(2)])
    assert torch.equal(output, expected), "the gathered values"
    return [output]


ASYNC_ITERATION = 7


def async_save_without_wait(directory: str) -> list[object]:
    """A background checkpoint save (``async_save_checkpoint``) the program never waits for.

    The writer thread is not a daemon, so the interpreter finishes the write before it exits;
    the caller checks that the tracker names ``ASYNC_ITERATION`` after every rank exited 0. Run it
    without ``destroy``: ``destroy_process_group()`` before the write finished fails the write
    (its collectives need the group), which the exit then reports (``AsyncSave``).
    """
    from megatron_fsdp.checkpoint import async_save_checkpoint

    model = build("ours")
    io_group = dist.new_group(backend="gloo")
    pending = async_save_checkpoint(directory, ASYNC_ITERATION, model, io_group=io_group)
    return [model, pending]


SCENARIOS = {
    "ours": lambda directory: round_trip("ours", directory),
    "fsdp2": lambda directory: round_trip("fsdp2", directory),
    "collectives": collectives,
    "async_save": async_save_without_wait,
}


def run(rank: int, port: int, scenarios: tuple[str, ...], directory: str, destroy: bool = True) -> None:
    """One rank running ``scenarios`` in order then exiting, started by a spawner (``torch.multiprocessing``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    main(scenarios, directory, destroy)


def main(scenarios: tuple[str, ...], directory: str, destroy: bool = True) -> None:
    """``destroy``: end with ``destroy_process_group()`` (torchtitan's habit); Megatron-LM's scripts just return."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    kept = []  # alive through the teardown, as a user's models are
    for name in scenarios:
        path = os.path.join(directory, name)
        os.makedirs(path, exist_ok=True)
        kept.append(SCENARIOS[name](path))
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(tuple(sys.argv[1].split(",")), sys.argv[2], destroy=len(sys.argv) < 4 or sys.argv[3] != "--no-destroy")

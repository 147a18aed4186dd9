"""Checkpoints of the whole-model API carry no wrapper prefix (issue 18), at 2 and 4 gloo ranks.

``fully_shard_model``, the one-line ``fully_shard(model, optimizer, ...)`` and the
Megatron adapter wrap the model (``.module``); their checkpoints must use the
model's own FQNs, so that they load into per-module ``fully_shard``, DDP and plain
models and back, through ``save_state``/``load_state``, ``save_checkpoint``, PyTorch's
DCP state-dict helpers, ``load_state_dict`` and the full-state-dict export.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import (
    CheckpointMismatchError,
    DistributedDataParallelConfig,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_fsdp.checkpoint import iteration_dir, load_checkpoint, load_state, save_checkpoint, save_state
from megatron_fsdp.checkpoint.cli import main as checkpoint_cli
from megatron_fsdp.checkpoint.export import export_full_state_dict, import_full_state_dict
from megatron_fsdp.checkpoint.safetensors_stream import read_header
from megatron_fsdp.mcore import FullyShardedDataParallel
from tests.distributed.harness import check, shared_tmpdir
from tests.models import Block, Net, global_batch, loss_fn

SUITE = "wrapper_prefix"
PLAIN_KEYS = list(Net().state_dict())  # the model's own FQNs: what every checkpoint must use


# -- the ways a model is held -------------------------------------------------------------------


def whole_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard_model(Net(), fsdp_unit_modules=[Block])
    return model, fully_shard_optimizer(adamw(model))


def one_line(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    model, opt = fully_shard(net, adamw(net), fsdp_unit_modules=[Block], zero_dp_strategy=2)
    return model, opt


def adapter(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
    model = FullyShardedDataParallel(object(), ddp_config, Net(), fsdp_unit_modules=[Block])
    return model, adamw(model)


def per_module(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, adamw(model)


def ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DDP(Net(), find_unused_parameters=True)
    return model, adamw(model)


def plain(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The unwrapped model, identical on every rank (trained on the global batch)."""
    torch.manual_seed(seed)
    model = Net()
    return model, adamw(model)


WRAPPED = {"fully_shard_model": whole_model, "fully_shard(model, optimizer)": one_line, "adapter": adapter}
OTHERS = {"per-module fully_shard": per_module, "DDP": ddp, "plain": plain}


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(kind: Callable, model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        batch = global_batch(step, 1, per_rank=4)
        if kind is not plain:
            batch = batch.chunk(n)[rank]
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()


# -- what a model holds, by FQN, as full tensors ------------------------------------------------


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in get_model_state_dict(model).items()}


def moments(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = get_optimizer_state_dict(model, opt)["state"]
    return {f"{fqn}.{k}": full(v) for fqn, s in state.items() for k, v in s.items() if k != "step"}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want) or set(got) == set(want), f"{what}: keys differ: {set(got) ^ set(want)}"
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs"


# -- checks -------------------------------------------------------------------------------------


@check(SUITE)
def wrappers_show_the_models_own_names() -> None:
    for name, build in WRAPPED.items():
        model, opt = build(0)
        train(build, model, opt, steps=1)
        for what, keys in (
            ("state_dict()", list(model.state_dict())),
            ("get_model_state_dict", list(get_model_state_dict(model))),
        ):
            assert keys == PLAIN_KEYS, f"{name} {what}: {keys[:3]} ..."
        names = [k for k, _ in model.named_parameters()]
        assert names == [k for k, _ in Net().named_parameters()], f"{name} named_parameters: {names[:3]}"
        osd = get_optimizer_state_dict(model, opt)
        assert set(osd["state"]) <= set(PLAIN_KEYS) and osd["state"], f"{name}: {sorted(osd['state'])[:3]}"
        assert all(p in PLAIN_KEYS for g in osd["param_groups"] for p in g["params"]), name
        # load_state_dict takes the keys state_dict gave; a prefixed key is reported, not taken.
        model.load_state_dict(model.state_dict())
        report = model.load_state_dict({"module.embed.weight": torch.zeros(1)}, strict=False)
        assert report.unexpected_keys == ["module.embed.weight"], f"{name}: {report}"
        assert "embed.weight" in report.missing_keys, f"{name}: {report.missing_keys[:3]}"


@check(SUITE)
def round_trip_with_every_other_form() -> None:
    """Whole-model <-> per-module / DDP / plain through save_state/load_state, weights and moments bitwise.

    Each form saves once; every wrapped form's checkpoint loads into each other form and back (18 loads).
    """
    with shared_tmpdir("prefix_") as root:
        saved = {}  # form -> (its checkpoint, its weights and moments when saved)
        for name, build in {**WRAPPED, **OTHERS}.items():
            path = os.path.join(root, build.__name__)
            model, opt = build(0)
            train(build, model, opt)
            save_state(path, model, opt)
            keys = FileSystemReader(path).read_metadata().state_dict_metadata
            assert "model.embed.weight" in keys and "optim.state.embed.weight.exp_avg" in keys, name
            assert not any(".module." in k or k.startswith("model.module") for k in keys), name
            saved[name] = (path, weights(model), moments(model, opt))
        for wrapped_name, wrapped in WRAPPED.items():
            for other_name, other in OTHERS.items():
                for src_name, (dst_name, dst) in ((wrapped_name, (other_name, other)),
                                                  (other_name, (wrapped_name, wrapped))):
                    what = f"{src_name} -> {dst_name}"
                    path, want_weights, want_moments = saved[src_name]
                    loaded, loaded_opt = dst(7)
                    train(dst, loaded, loaded_opt, steps=1)  # optimizer state to overwrite
                    load_state(path, loaded, loaded_opt)
                    assert_same(weights(loaded), want_weights, what)
                    assert_same(moments(loaded, loaded_opt), want_moments, what)


@check(SUITE)
def dcp_recipe_and_load_state_dict_interoperate() -> None:
    # PyTorch's plain recipe on the wrapper, loaded into DDP by load_state, and the reverse.
    with shared_tmpdir("prefix_") as root:
        model, opt = whole_model(0)
        train(whole_model, model, opt)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=os.path.join(root, "recipe"))
        target, target_opt = ddp(3)
        train(ddp, target, target_opt, steps=1)
        load_state(os.path.join(root, "recipe"), target, target_opt)
        assert_same(weights(target), weights(model), "DCP recipe on fully_shard_model -> DDP")
        assert_same(moments(target, target_opt), moments(model, opt), "DCP recipe on fully_shard_model -> DDP")
        # set_*_state_dict with another form's state dicts, full and sharded
        fresh, fresh_opt = one_line(5)
        train(one_line, fresh, fresh_opt, steps=1)
        set_model_state_dict(fresh, get_model_state_dict(target))
        # strict=False: PyTorch's loader insists on state for parameters that never had a gradient
        # (the probe block), for any model (docs/checkpointing.md); it leaves theirs as it was.
        set_optimizer_state_dict(fresh, fresh_opt, get_optimizer_state_dict(target, target_opt),
                                 options=StateDictOptions(strict=False))
        assert_same(weights(fresh), weights(model), "DDP state dicts -> set_*_state_dict on the one-line form")
        got, want = moments(fresh, fresh_opt), moments(model, opt)
        assert_same({k: got[k] for k in want}, want, "DDP state dicts -> set_*_state_dict on the one-line form")
    # nn.Module.load_state_dict with a plain model's full tensors, and the wrapper's back into a plain model
    reference, _ = plain(11)
    model, _ = whole_model(0)
    model.load_state_dict(reference.state_dict())
    assert_same(weights(model), weights(reference), "plain state_dict -> fully_shard_model.load_state_dict")
    back = Net()
    back.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
    assert_same(weights(back), weights(reference), "fully_shard_model.state_dict -> plain load_state_dict")
    # The next forward uses the loaded weights.
    batch = global_batch(0, 1, per_rank=4).chunk(dist.get_world_size())[dist.get_rank()]
    with torch.no_grad():
        assert torch.equal(loss_fn(model, batch), loss_fn(reference, batch)), "loaded weights unused"


@check(SUITE)
def megatron_layout_and_export_use_plain_names() -> None:
    with shared_tmpdir("prefix_") as root:
        for name, build in WRAPPED.items():
            save_dir = os.path.join(root, build.__name__)
            model, opt = build(0)
            train(build, model, opt)
            save_checkpoint(save_dir, 3, model, opt, extra={"k": 1})
            keys = FileSystemReader(iteration_dir(save_dir, 3)).read_metadata().state_dict_metadata
            assert sorted(k[len("model."):] for k in keys if k.startswith("model.")) == sorted(PLAIN_KEYS), name
            # into a DDP model and a plain one (the Megatron layout)
            for other in (ddp, plain):
                target, target_opt = other(4)
                load_checkpoint(save_dir, target, target_opt, load_rng=False)
                assert_same(weights(target), weights(model), f"{name} save_checkpoint -> {other.__name__}")
            # export from the directory (the CLI) and from the live wrapper
            cli_file = os.path.join(root, f"{build.__name__}_cli.safetensors")
            live_file = os.path.join(root, f"{build.__name__}_live.safetensors")
            if dist.get_rank() == 0:
                assert checkpoint_cli(["export", "--checkpoint", save_dir, "--output", cli_file]) == 0
            dist.barrier()
            export_full_state_dict(model, live_file)
            for path in (cli_file, live_file):
                exported = sorted(read_header(path)[0])
                assert exported == sorted(PLAIN_KEYS), f"{name} export {os.path.basename(path)}: {exported[:3]}"
            # and the exported file back into a fresh wrapper, strict
            fresh, _ = build(9)
            import_full_state_dict(cli_file, fresh)
            assert_same(weights(fresh), weights(model), f"{name}: exported file -> import_full_state_dict")


@check(SUITE, world_sizes=(2,))
def prefixed_checkpoint_is_a_named_mismatch() -> None:
    # A checkpoint that does carry a wrapper prefix (written from the wrapped module's parent
    # by hand) is refused with every key named, as for any other mismatch.
    with shared_tmpdir("prefix_") as root:
        model, _ = plain(0)
        dcp.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=root)
        target, _ = whole_model(1)
        try:
            load_state(root, target)
        except CheckpointMismatchError as e:
            # both sides named: the model's plain keys missing, the prefixed ones unexpected
            message = str(e)
            assert "missing from the checkpoint: model." in message and "model.embed.weight" in message, message
            assert "unexpected" in message and "model.module." in message, message
        else:
            raise AssertionError("a prefixed checkpoint loaded into fully_shard_model")

"""The front-end's shape: typed config derived once, frozen flags, the loop driven through a backend interface."""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron.training import trainer
from megatron.training.arguments import parse_args, validate_args
from megatron.training.backends import DataParallelBackend, DDPBackend, FSDPBackend
from megatron.training.config import FrozenArgs, RunState, TrainingConfig, freeze_args, init_num_microbatches
from megatron.training.model_setup import build_adamw
from megatron.training.parallel_state import GroupOfRanks, ParallelLayout
from megatron.training.trainer import Trainer
from megatron_fsdp.parallel import TensorParallel
from tests.unit.frontend.test_frontend_model import scheduler_for

FLAGS = ["--mock-data", "--vocab-size", "50", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
         "2", "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
         "--lr", "1e-2", "--clip-grad", "0.5", "--log-interval", "1"]


@pytest.fixture
def one_rank():
    """A one-rank process group (torch's fake backend: at world size 1 every collective is the identity)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_config_is_derived_once_from_the_validated_flags():
    args = validate_args(parse_args(FLAGS + ["--eval-interval", "2", "--no-check-for-nan-in-loss-and-grad"]), 1)
    assert init_num_microbatches(args) == 2  # megatron-core's calculator: 4 / (2 x 1)
    config = TrainingConfig.from_args(args)
    assert (config.train_iters, config.global_batch_size, config.num_microbatches) == (3, 4, 2)
    assert (config.clip_grad, config.eval_interval, config.check_for_nan) == (0.5, 2, False)
    with pytest.raises(AttributeError):
        config.train_iters = 5  # frozen dataclass


def test_frozen_flags_read_as_before_and_refuse_writes_naming_the_attribute():
    args = validate_args(parse_args(FLAGS), 1)
    frozen = freeze_args(args)
    assert isinstance(frozen, FrozenArgs) and vars(frozen) == vars(args)
    with pytest.raises(AttributeError, match=r"args\.consumed_train_samples: the flags are read-only.*RunState"):
        frozen.consumed_train_samples = 8
    with pytest.raises(AttributeError, match=r"args\.lr"):
        del frozen.lr
    assert frozen.lr == 1e-2


def test_the_loop_knows_no_wrapper_class():
    """The trainer reaches DDP and FSDP only through DataParallelBackend (no isinstance on the model)."""
    tree = ast.parse(inspect.getsource(trainer))
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "isinstance" not in calls and "type" not in calls
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m.startswith(("megatron_fsdp", "torch.nn.parallel"))}, imported
    for backend in (DDPBackend, FSDPBackend):  # every abstract method implemented
        assert not backend.__abstractmethods__, backend
    assert DataParallelBackend.__abstractmethods__ == {
        "accumulation", "zero_grad", "finish_grad_sync", "scale_gradients"}


class RecordingBackend(DataParallelBackend):
    """A third backend (the plain module at one rank) that records what the loop asks of it."""

    def __init__(self, model: torch.nn.Module) -> None:
        layout = ParallelLayout(None, TensorParallel.single(), GroupOfRanks.single(), dist.group.WORLD,
                                dist.group.WORLD, dp_rank=0, dp_size=1)
        super().__init__(model, torch.device("cpu"), layout)
        self.calls: list[tuple] = []

    def accumulation(self, is_first: bool, is_last: bool):
        self.calls.append(("accumulation", is_first, is_last))
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.calls.append(("zero_grad",))

    def finish_grad_sync(self) -> None:
        self.calls.append(("finish_grad_sync",))

    def scale_gradients(self, factor: float) -> None:
        self.calls.append(("scale_gradients", factor))


def _forward_step(batch: dict, model: torch.nn.Module):
    positions = torch.arange(batch["tokens"].shape[1]).expand_as(batch["tokens"])
    return model(batch["tokens"], positions, None, labels=batch["labels"]), batch["loss_mask"]


@pytest.fixture
def mcore_rank(gloo_rank):
    """A one-rank gloo group (megatron-core lays out gloo groups of its own: not on the fake backend) whose
    megatron-core parallel state is destroyed after the test."""
    yield
    from megatron.training.mcore_model import destroy_mcore_parallel

    destroy_mcore_parallel()


def test_trainer_drives_any_backend_and_trains_like_a_plain_loop(mcore_rank, monkeypatch):
    args = validate_args(parse_args(FLAGS), 1)
    args.padded_vocab_size = 50  # what pretrain derives from the tokenizer
    args.num_microbatches = init_num_microbatches(args)
    args = freeze_args(args)
    config = TrainingConfig.from_args(args)
    torch.manual_seed(0)
    from megatron.training.mcore_model import mcore_gpt_model

    model_args = validate_args(parse_args([*FLAGS, "--attention-dropout", "0", "--hidden-dropout", "0"]), 1)
    model_args.padded_vocab_size = 50
    model = mcore_gpt_model(model_args)  # megatron-core's GPTModel, as pretrain_gpt.py builds it
    torch.manual_seed(0)
    reference = mcore_gpt_model(model_args)  # a second build from the same seed (it holds process groups: no deepcopy)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(config.train_iters * config.num_microbatches):
        tokens = torch.randint(0, 50, (2, 9), generator=g)
        mask = (torch.rand(2, 8, generator=g) > 0.2).float()
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})

    backend = RecordingBackend(model)
    optimizer = build_adamw(args, model)
    scheduler = scheduler_for(optimizer, max_lr=args.lr, min_lr=0.0, warmup_steps=0, decay_steps=3,
                              decay_style="constant", weight_decay=args.weight_decay)
    state = RunState()
    # The loop's host reads of device values (each is a CPU/GPU sync on CUDA; the optimizer's own are not counted).
    reads = {"item": 0, "tolist": 0}
    for method in reads:
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _original=original, _method=method, **k):
            reads[_method] += sys._getframe(1).f_code.co_filename == trainer.__file__
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    result = Trainer(args, config, backend, optimizer, scheduler, _forward_step, state).train(iter(batches), None)
    monkeypatch.undo()
    assert reads == {"item": 0, "tolist": 3}, reads  # one read per step, none per micro-batch

    per_step = [("zero_grad",), ("accumulation", True, False), ("accumulation", False, True), ("finish_grad_sync",)]
    assert backend.calls == per_step * 3
    assert (state.iteration, state.consumed_train_samples, result.iteration) == (3, 12, 3)

    ref_opt = build_adamw(args, reference)
    data = iter(batches)
    for it in range(1, 4):
        ref_opt.zero_grad(set_to_none=True)
        mean_sum = 0.0
        for _ in range(2):
            batch = next(data)
            losses, mask = _forward_step(batch, reference)
            masked = (losses.float() * mask).sum()
            (masked / mask.sum() / 2).backward()
            mean_sum += masked.item() / mask.sum().item()
        # Megatron's global norm (get_grad_norm_fp32): the square root of the summed squared per-tensor norms, then
        # torch's clipping by it (torch's clip_grad_norm_ takes the norm of the norms: other rounding, 1 ulp apart
        # here on megatron-core's model)
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        norm = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum() ** 0.5
        torch.nn.utils.clip_grads_with_norm_(list(reference.parameters()), 0.5, norm)
        ref_opt.step()
        assert result.losses[it] == mean_sum / 2 and result.grad_norms[it] == float(norm), it
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert all(math.isfinite(v) for v in result.losses.values())


"""PyTorch's own FSDP2 test scenarios, run on ``megatron_fsdp.fully_shard`` with only the import changed.

Ported from PyTorch's test/distributed/_composable/fsdp/ (test_fully_shard_training.py,
_autograd, _frozen, _state_dict, _mixed_precision, _init, _clip_grad_norm_, _grad_scaler,
_comm): the models' shapes, the training loops and the references they compare with
(``replicate``/DDP, or a plain model whose gradients are averaged by hand), at FSDP2's
tolerance (``assertEqual``: float32 rtol 1.3e-6, atol 1e-5). Their test infrastructure
(patched collectives, sleeps, CommDebugMode counts of FSDP2's own collectives) is not
ported; where the original counts collectives, the count is taken from our
``fsdp_comm_stats``. Variants that need an FSDP2 API we do not have yet
(``reshard_after_forward=2``, ``set_reshard_after_backward``, ``set_is_last_backward``,
``unshard(async_op=True)``, lists of modules, explicit prefetch lists, ``shard_placement_fn``,
offload) are left out; docs/fsdp2.md lists each API's status.

One suite in three files (one process group per world size): this module (training,
gradient accumulation, parameter registration, communication counts) imports
``fsdp2_port_autograd_checks`` (autograd, frozen parameters) and
``fsdp2_port_state_checks`` (state dicts, DCP, meta init, mixed precision, clipping, the
gradient scaler); models and parity helpers are in ``fsdp2_port_models``.
"""

from __future__ import annotations

import copy
import gc
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    apply_activation_checkpointing,
)
from torch.distributed.tensor import DTensor

from megatron_fsdp import FSDPModule, fully_shard

# The other scenarios of this suite: imported so that their checks register (one process group).
from tests.distributed.core import fsdp2_port_autograd_checks, fsdp2_port_state_checks  # noqa: F401 - they register
from tests.distributed.core.fsdp2_port_models import (
    MLP,
    SUITE,
    ModelArgs,
    Transformer,
    TransformerBlock,
    assert_equal,
    assert_sharded_parity,
    average_gradients,
    ddp_reference,
    rank_world,
    shard_blocks_then_root,
    train_against,
)
from tests.distributed.harness import check

__all__ = ["SUITE"]


# -- test_fully_shard_training.py -------------------------------------------------------


@check(SUITE, world_sizes=(2, 4))
def train_parity_single_group() -> None:
    """TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0: root only, three shapes."""
    rank, _ = rank_world()
    for lin_shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn((4, lin_shapes[0][0]))
        train_against(ref_model, ref_optim, model, optim, lambda _, inp=inp: inp, f"shapes {lin_shapes}")


@check(SUITE)
def train_parity_multi_group() -> None:
    """test_train_parity_multi_group: a Transformer, fully_shard per block then root, vs DDP."""
    rank, _ = rank_world()
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        args = ModelArgs(n_layers=3, vocab_size=128, max_seq_len=16)
        model = Transformer(args)
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        shard_blocks_then_root(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inputs = [torch.randint(0, args.vocab_size, (3, 16)) for _ in range(10)]
        train_against(ref_model, ref_optim, model, optim, inputs.__getitem__,
                      f"reshard_after_forward={reshard_after_forward}")


@check(SUITE)
def non_root_forward_backward() -> None:
    """test_non_root_forward_backward: a step through the root, then one through a non-root block alone."""
    rank, world = rank_world()
    torch.manual_seed(42)
    lin_dim = 32
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + rank)
    inp = torch.randn((8, lin_dim))

    ref_root_loss = ref_model(inp).sum()
    ref_root_loss.backward()
    average_gradients(ref_model)
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref_model[0](inp).sum()
    ref_nonroot_loss.backward()
    average_gradients(ref_model)
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()

    assert_equal(root_loss, ref_root_loss, "root loss")
    assert_equal(nonroot_loss, ref_nonroot_loss, "non-root loss")
    assert_equal(model(inp).sum(), ref_model(inp).sum(), "loss after both steps")


class MultiForwardModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.inner(x)
        j = self.inner(x)
        return self.outer(i + j)


@check(SUITE)
def multi_forward_module() -> None:
    """test_multi_forward_module: one sharded module called twice in a forward, vs DDP."""
    rank, _ = rank_world()
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        inp = torch.randn((32, 4))
        train_against(ref_model, ref_optim, model, optim, lambda _, inp=inp: inp,
                      f"reshard_after_forward={reshard_after_forward}")


@check(SUITE, world_sizes=(2,))  # the original runs at 2 ranks
def train_parity_with_activation_checkpointing() -> None:
    """test_train_parity_with_activation_checkpointing, module_grouping="block": three AC implementations.

    "composable" (torch.distributed._composable.checkpoint on each block), "utils"
    (torch.utils.checkpoint inside the model's forward) and "wrapper"
    (apply_activation_checkpointing before fully_shard); tied embeddings as in the original.
    The original's "mem_eff" groupings need ``fully_shard`` of a list of modules (not here yet).
    """
    rank, _ = rank_world()
    for reshard_after_forward, impl in itertools.product((True, False), ("composable", "utils", "wrapper")):
        what = f"reshard_after_forward={reshard_after_forward} {impl}"
        torch.manual_seed(42)
        args = ModelArgs(n_layers=3, vocab_size=128, max_seq_len=16, checkpoint_activations=(impl == "utils"))
        model = Transformer(args)
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        prefixes = ()
        if impl == "wrapper":
            prefixes = (_CHECKPOINT_PREFIX,)
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        elif impl == "composable":
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    checkpoint(module)
        shard_blocks_then_root(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        inp = torch.randint(0, args.vocab_size, (3, 16))
        assert_sharded_parity(ref_model, model, f"{what} before training", prefixes)
        for iter_idx in range(10):
            losses = [m(inp).sum() for m in (ref_model, model)]
            for loss in losses:
                loss.backward()
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx} after backward", prefixes)
            assert_equal(losses[1], losses[0], f"{what} iter {iter_idx}: loss")
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx} after step", prefixes)


@check(SUITE)
def train_parity_with_shared_params() -> None:
    """TestFullyShardSharedParams.test_train_parity_with_shared_params: tied embedding/output, with and without AC."""
    rank, _ = rank_world()
    for reshard_after_forward, use_ac in itertools.product((False, True), (False, True)):
        torch.manual_seed(42)
        args = ModelArgs(n_layers=3, weight_tying=True)
        model = Transformer(args)
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                if use_ac:
                    checkpoint(module)
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        assert model.output.weight is model.tok_embeddings.weight, "the tie must survive fully_shard"
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inputs = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(10)]
        train_against(ref_model, ref_optim, model, optim, inputs.__getitem__,
                      f"reshard_after_forward={reshard_after_forward} ac={use_ac}")


@check(SUITE)
def train_shared_params_uneven_shard() -> None:
    """test_train_shared_params_uneven_shard: a tied vocabulary of world*4+1 rows; every row is trained.

    The original puts both tied modules in one ``fully_shard([...])`` group; here their
    common parent owns the tied weight (the same unit, FSDP2's requirement).
    """
    rank, world = rank_world()
    hidden, vocab = 16, world * 4 + 1

    class TiedModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, hidden)
            self.output = nn.Linear(hidden, vocab, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.output(self.tok_embeddings(ids))

    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = TiedModel()
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        model.unshard()
        initial = model.tok_embeddings.weight.detach().clone()
        model.reshard()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        for _ in range(10):
            ids = torch.randint(0, vocab, (2, 8))
            loss = F.cross_entropy(model(ids).view(-1, vocab).float(), ids.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.unshard()
        final = model.tok_embeddings.weight
        assert not isinstance(final, DTensor), "unshard() must install the unsharded weight"
        for row in range(vocab):
            assert not torch.equal(initial[row], final[row]), f"row {row} was not updated"
        model.reshard()


@check(SUITE)
def layer_by_layer_shard_no_false_positive() -> None:
    """test_layer_by_layer_shard_no_false_positive: blocks appended and sharded one by one with gc between."""

    dim = 16

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.linear = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.norm(x))

    class LayerByLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    model = LayerByLayer()
    for _ in range(8):
        block = SimpleBlock()
        model.blocks.append(block)
        fully_shard(block)
        gc.collect()
    fully_shard(model)
    model(torch.randn(2, 4, dim)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# -- gradient accumulation (TestFullyShardGradientAccumulation) ----------------------------


def set_backward_flags(model: nn.Module, mode: str, is_last: bool, num_disabled: int) -> None:
    """test_gradient_accumulation's modes: sync off for every unit, the root only, or the first MLPs."""
    if mode == "all":
        model.set_requires_gradient_sync(is_last)
    elif mode == "some_mlps":
        for mlp in model[1:1 + num_disabled]:
            mlp.set_requires_gradient_sync(is_last)
    else:
        model.set_requires_gradient_sync(is_last, recurse=False)


@check(SUITE, world_sizes=(2, 4))
def gradient_accumulation() -> None:
    """test_gradient_accumulation with set_requires_gradient_sync: modes "all", "root_only", "some_mlps".

    Reshard after backward on (the original's ``reshard_after_backward=False`` variant needs
    ``set_reshard_after_backward``). Reduce-scatter counts as in the original: one per unit
    on the last micro-batch, plus one per micro-batch for each unit left syncing.
    """
    rank, _ = rank_world()
    batch_size, lin_dim, num_mlps, num_microbatches = 2, 32, 3, 3
    for reshard_after_forward, mode in itertools.product((True, False), ("all", "root_only", "some_mlps")):
        what = f"reshard_after_forward={reshard_after_forward} mode={mode}"
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(lin_dim, lin_dim), *[MLP(lin_dim) for _ in range(num_mlps)])
        ref_model = copy.deepcopy(model)
        for mlp in model[1:]:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)  # the root gets the first linear
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        num_disabled = 2

        torch.manual_seed(42 + rank + 1)
        stats = model.fsdp_comm_stats
        for iter_idx in range(5):
            stats.reset()
            for microbatch_idx in range(num_microbatches):
                set_backward_flags(model, mode, microbatch_idx == num_microbatches - 1, num_disabled)
                inp = torch.randn(batch_size, lin_dim)
                losses = []
                for _model in (ref_model, model):
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                assert_equal(losses[1], losses[0], f"{what} iter {iter_idx} microbatch {microbatch_idx}: loss")
            expected = num_mlps + 1
            if mode == "some_mlps":
                expected += (num_mlps - num_disabled + 1) * (num_microbatches - 1)
            elif mode == "root_only":
                expected += num_mlps * (num_microbatches - 1)
            assert stats.calls["reduce_scatter"] == expected, (
                f"{what}: {stats.calls['reduce_scatter']} reduce-scatters, FSDP2 issues {expected}"
            )
            average_gradients(ref_model)
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 1))


@check(SUITE)
def microbatching_1f1b() -> None:
    """test_1f1b_microbatching without the APIs still being added: reshard_after_forward=False, sync on the last.

    The original also calls ``set_is_last_backward`` and ``unshard(async_op=True)``; here
    the explicit-unshard variant calls ``unshard()`` (synchronous) on every unit first.
    """
    rank, _ = rank_world()
    for use_explicit_unshard in (False, True):
        torch.manual_seed(42)
        args = ModelArgs()
        model = Transformer(args)
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        shard_blocks_then_root(model, reshard_after_forward=False)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inps = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(3)]
        if use_explicit_unshard:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        losses, ref_losses = [], []
        for idx, inp in enumerate(inps):
            model.set_requires_gradient_sync(idx == len(inps) - 1)
            losses.append(model(inp).sum())
            losses[-1].backward()
            ref_losses.append(ref_model(inp).sum())
            ref_losses[-1].backward()
        average_gradients(ref_model)
        for i, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
            assert_equal(loss, ref_loss, f"explicit_unshard={use_explicit_unshard} microbatch {i}")
        optim.step()
        ref_optim.step()
        assert_sharded_parity(ref_model, model, f"explicit_unshard={use_explicit_unshard}")



# -- parameter registration, inputs (test_fully_shard_training.py) -------------------------


def same_values(model: nn.Module, ref_model: nn.Module, what: str) -> None:
    """Sharded (DTensor) or unsharded, every parameter holds the reference's values."""
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_equal(p.full_tensor() if isinstance(p, DTensor) else p, q, f"{what}: {name}")


@check(SUITE)
def param_registration_after_forward_and_backward() -> None:
    """test_param_registration_after_forward/_after_backward: which parameters a module holds when.

    Differs from FSDP2 in one place, on purpose: FSDP2 reshards a root given an explicit
    ``reshard_after_forward=True`` after its forward; ours never reshards the root between
    its forward and backward (its weights are needed first in backward), as FSDP2 does
    for its default (``None``). Non-root units follow the flag as in FSDP2.
    """
    for reshard_after_forward in (True, False):
        what = f"reshard_after_forward={reshard_after_forward}"
        torch.manual_seed(42)
        model = nn.Sequential(MLP(3), MLP(3))
        ref_model = copy.deepcopy(model)
        fully_shard(model[0].in_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model[0].out_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((2, 3))

        assert all(isinstance(p, DTensor) for p in model.parameters()), f"{what}: DTensors before forward"
        same_values(model, ref_model, f"{what} before forward")
        model(inp)
        non_root = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
        root = [p for p in model.parameters() if not any(p is q for q in non_root)]
        assert all(isinstance(p, DTensor) == reshard_after_forward for p in non_root), f"{what}: non-root after forward"
        assert not any(isinstance(p, DTensor) for p in root), f"{what}: the root keeps its weights gathered"
        same_values(model, ref_model, f"{what} after forward")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # "however, we can manually reshard"
        assert all(isinstance(p, DTensor) for p in model.parameters()), f"{what}: DTensors after reshard()"
        same_values(model, ref_model, f"{what} after reshard")
        model(inp).sum().backward()
        assert all(isinstance(p, DTensor) for p in model.parameters()), f"{what}: DTensors after backward"


@check(SUITE, world_sizes=(2,))  # the original runs at 2 ranks
def root_with_no_forward_inputs() -> None:
    """test_root_no_forward_inputs: a root whose forward takes no arguments trains; gradients match."""

    class ParameterOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self) -> torch.Tensor:
            return self.weight @ self.weight

    torch.manual_seed(42)
    model = ParameterOnly()
    ref_model = copy.deepcopy(model)
    fully_shard(model)
    out = model()
    assert out.shape == (4, 4)
    out.sum().backward()
    ref_model().sum().backward()
    assert_sharded_parity(ref_model, model, "parameter-only root")


# -- communication count and prefetch (test_fully_shard_comm.py) --------------------------


@check(SUITE)
def communication_count_and_prefetch_depth() -> None:
    """test_fully_shard_communication_count, with our set_prefetch_depth for FSDP2's prefetch lists.

    Blocks plus root: forward all-gathers num_blocks + 1; backward all-gathers num_blocks
    again when blocks reshard after forward (the root is not resharded), else none;
    num_blocks + 1 reduce-scatters. Prefetching more units ahead changes when, never how
    many, and the training matches DDP at every depth.
    """
    rank, _ = rank_world()
    args = ModelArgs(n_layers=3)
    for reshard_after_forward, depth in itertools.product((True, False), (0, 1, 2)):
        what = f"reshard_after_forward={reshard_after_forward} prefetch_depth={depth}"
        torch.manual_seed(42)
        model = Transformer(args)
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        shard_blocks_then_root(model, reshard_after_forward=reshard_after_forward)
        model.set_prefetch_depth(depth)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stats = model.fsdp_comm_stats
        torch.manual_seed(42 + rank)
        inp = torch.randint(0, args.vocab_size, (2, 16))
        for iter_idx in range(3):
            stats.reset()
            loss = model(inp).sum()
            assert stats.calls["all_gather"] == args.n_layers + 1, f"{what}: forward all-gathers {dict(stats.calls)}"
            assert stats.calls["reduce_scatter"] == 0, what
            stats.reset()
            loss.backward()
            expected_gathers = args.n_layers if reshard_after_forward else 0
            assert stats.calls["all_gather"] == expected_gathers, f"{what}: backward all-gathers {dict(stats.calls)}"
            assert stats.calls["reduce_scatter"] == args.n_layers + 1, f"{what}: reduce-scatters {dict(stats.calls)}"
            ref_loss = ref_model(inp).sum()
            ref_loss.backward()
            assert_equal(loss, ref_loss, f"{what} iter {iter_idx}: loss")
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad()



@check(SUITE)
def multiple_forwards_before_backward() -> None:
    """Two forwards of the whole model, one backward of the summed losses (two views of a batch), vs averaged grads.

    Not one of FSDP2's test files: its training tests run one forward per backward. The
    reference is a plain model whose gradients are averaged by hand (DDP refuses a second
    forward before backward without static_graph).
    """
    rank, _ = rank_world()
    for reshard_after_forward in (True, False):
        what = f"reshard_after_forward={reshard_after_forward}"
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(16) for _ in range(3)])
        ref_model = copy.deepcopy(model)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        for iter_idx in range(5):
            x1, x2 = torch.randn((4, 16)), torch.randn((4, 16))
            losses = []
            for _model in (ref_model, model):
                losses.append(_model(x1).sum() + _model(x2).square().sum())
                losses[-1].backward()
            average_gradients(ref_model)
            assert_equal(losses[1], losses[0], f"{what} iter {iter_idx}: loss")
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad()


"""The models of PyTorch's FSDP2 tests, rebuilt small for CPU, and the parity checks they use.

PyTorch's tests take ``MLP``, ``DoubleLinear`` (torch.testing._internal.common_fsdp) and
``Transformer`` (common_dtensor); those are internal to torch and change between
releases, so the scenarios in ``fsdp2_port_checks.py`` use these copies of their shapes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as checkpoint_fn

from megatron_fsdp import fully_shard
from tests.distributed.shards import assert_sharded

SUITE = "fsdp2_port"
# World sizes follow the originals: checks whose test class runs at 2 ranks are registered
# at (2,) only; the rest (originals at 4 or 8) at 2 and 4.


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """FSDP2's tests compare with ``TestCase.assertEqual``: for float32, rtol 1.3e-6 and atol 1e-5.

    ``torch.testing.assert_close`` has the same defaults per dtype; they are written out here.
    """
    rtol, atol = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}.get(expected.dtype, (1e-7, 1e-7))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


class MLP(nn.Module):
    """common_fsdp.MLP: in_proj (dim -> 4 dim), relu, out_proj, relu, plus an optional buffer."""

    def __init__(self, dim: int, with_buffer: bool = False, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * dim_multiplier)
        self.out_proj = nn.Linear(dim * dim_multiplier, dim)
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return z if self.buffer is None else z + self.buffer

    def reset_parameters(self) -> None:
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class DoubleLinear(nn.Module):
    """common_fsdp.DoubleLinear: two linears on the same input; one or two outputs."""

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - one tensor or a pair, as the original
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


@dataclass
class ModelArgs:
    """common_dtensor.ModelArgs, scaled down for CPU."""

    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    weight_tying: bool = True
    checkpoint_activations: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        heads = (w(x).view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k, v = heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """common_dtensor.Transformer: token and position embeddings, blocks, norm, (tied) output."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            if self.model_args.checkpoint_activations:
                h = checkpoint_fn(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


def ddp_reference(model: nn.Module, find_unused_parameters: bool = False) -> DDP:
    """The reference FSDP2's tests build with ``replicate``: DDP over a copy, on gloo."""
    return DDP(copy.deepcopy(model), find_unused_parameters=find_unused_parameters)


def unwrap(reference: nn.Module) -> nn.Module:
    return reference.module if isinstance(reference, DDP) else reference


def assert_sharded_parity(reference: nn.Module, model: nn.Module, what: str, prefixes_to_ignore: tuple = ()) -> None:
    """common_fsdp.check_sharded_parity: every parameter a DTensor holding the reference's values, grads too.

    The original compares ``full_tensor()``s; each rank compares its shards with the same slices of
    the reference instead (tests/distributed/shards.py: the same elements at the same tolerance, one
    collective instead of an all-gather per parameter and gradient), and every rank raises if one differs.
    """
    ref_params = list(unwrap(reference).named_parameters())
    params = list(model.named_parameters())
    assert len(ref_params) == len(params), f"{what}: {len(params)} parameters, reference has {len(ref_params)}"
    pairs = []
    for (ref_name, ref_param), (name, param) in zip(ref_params, params):
        clean = name
        for prefix in prefixes_to_ignore:
            clean = clean.replace(prefix, "")
        assert clean == ref_name, f"{what}: parameter order differs: {name} vs {ref_name}"
        assert isinstance(param, DTensor), f"{what}: {name} is {type(param).__name__}, not a DTensor"
        pairs.append((f"{what}: {name}", param, ref_param))
        if ref_param.grad is None:
            assert param.grad is None, f"{what}: {name} has a gradient, the reference none"
        else:
            assert param.grad is not None, f"{what}: {name} has no gradient, the reference has"
            assert isinstance(param.grad, DTensor), f"{what}: {name}.grad is {type(param.grad).__name__}"
            pairs.append((f"{what}: {name}.grad", param.grad, ref_param.grad))
    assert_sharded(pairs, lambda a, e: assert_equal(a, e, "values differ"))


def average_gradients(reference: nn.Module) -> None:
    """What FSDP2's tests do with ``all_reduce(op=AVG)`` on a plain reference (gloo has no AVG)."""
    for param in reference.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def shard_blocks_then_root(model: Transformer, **kwargs) -> None:
    """torchtitan's and FSDP2's tests' wrapping: each TransformerBlock, then the root."""
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def train_against(reference, ref_optim, model, optim, inputs, what: str, iters: int = 10) -> None:
    """FSDP2's common loop: zero_grad (set_to_none alternating), forward ``.sum()``, backward, step; equal losses."""
    for iter_idx in range(iters):
        inp = inputs(iter_idx)
        losses = []
        for _model, _optim in ((reference, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        assert_equal(losses[1], losses[0], f"{what} iter {iter_idx}: loss")

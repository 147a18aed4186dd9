"""The Megatron adapter ``FullyShardedDataParallel``: config translation, methods, parity with DDP, errors.

Runs with and without megatron-core: with it (tests/distributed/mcore/test_mcore_model.py), megatron-core's
own config objects are passed and the adapter must be an instance of its data-parallel base class; without it
(test_mcore_adapter.py, where tests/no_megatron_core/ blocks ``import megatron.core``) ours are.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import FSDPModule, microbatch
from megatron_fsdp.mcore import FullyShardedDataParallel
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check

SUITE = "mcore_adapter"

try:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    HAVE_MCORE = True
except ImportError:
    from megatron_fsdp.api.config import DistributedDataParallelConfig

    HAVE_MCORE = False


def model_config(**fields):
    """megatron-core's TransformerConfig when installed (what Megatron passes), else a namespace."""
    if HAVE_MCORE:
        return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, **fields)
    return SimpleNamespace(**{"calculate_per_token_loss": False, "init_model_with_meta_device": False, **fields})


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """A pre-norm causal transformer layer; the adapter's default unit is any class of this name (a user's model:
    this suite runs without megatron-core too; megatron-core's own GPTModel under the adapter: mcore_model_checks)."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_norm, self.qkv, self.proj = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden), nn.Linear(hidden,
                                                                                                          hidden)
        self.mlp_norm, self.mlp = nn.LayerNorm(hidden), MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.input_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A plain-PyTorch GPT: embeddings, layers, final norm, untied output layer; per-token losses."""

    def __init__(self, vocab: int = 23, hidden: int = 16, heads: int = 2, ffn: int = 24, layers: int = 2,
                 max_positions: int = 12) -> None:
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, hidden), nn.Embedding(max_positions,
                                                                                                   hidden)
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, ffn) for _ in range(layers))
        self.final_norm, self.output_layer = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens) + self.position_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(self.final_norm(x))
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(7)
    return TinyGPT()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 23, (2 * dist.get_world_size(), 12), generator=g).chunk(dist.get_world_size())
    local = tokens[dist.get_rank()]
    return local[:, :-1], local[:, 1:]


def loss_of(model, step: int) -> torch.Tensor:
    tokens, labels = batch(step)
    return model(tokens, labels=labels).mean()


def adapter(strategy: str, base: nn.Module, config=None, **ddp_fields) -> FullyShardedDataParallel:
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                               **ddp_fields)
    return FullyShardedDataParallel(config or model_config(), ddp_config, copy.deepcopy(base))


@check(SUITE)
def parity_with_ddp_every_strategy() -> None:
    base = tiny_gpt()
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        for instances in (1, 2) if dist.get_world_size() == 4 else (1,):
            model = adapter(strategy, base, num_distributed_optimizer_instances=instances)
            if HAVE_MCORE:
                assert isinstance(model, _BaseDataParallel)
            layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
            assert len(layers) == 2 and all(isinstance(m, FSDPModule) for m in layers), "default units"
            ddp = DDP(copy.deepcopy(base))
            # SGD: Adam's m / sqrt(v) turns last-bit differences of near-zero gradients (4-rank sums in
            # another order) into visible ones; the engine's own tests cover Adam parity.
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                model.zero_grad_buffer()
                opt.zero_grad()
                ddp_opt.zero_grad()
                with microbatch(model, is_first=True, is_last=True):
                    loss_of(model, step).backward()
                model.finish_grad_sync()
                loss_of(ddp, step).backward()
                opt.step()
                ddp_opt.step()
                model.start_param_sync()
            reference = dict(ddp.module.named_parameters())
            for name, param in model.module.module.named_parameters():
                torch.testing.assert_close(param.full_tensor(), reference[name], rtol=1e-6, atol=1e-7,
                                           msg=f"{strategy} x{instances} {name}")
            if dist.get_world_size() == 2:  # a sum of two numbers does not depend on order
                assert torch.equal(model.module.module.layers[0].mlp.fc1.weight.full_tensor(),
                                   reference["layers.0.mlp.fc1.weight"]), strategy


@check(SUITE, world_sizes=(2,))
def methods_do_what_megatron_expects() -> None:
    base = tiny_gpt()
    model = adapter("optim_grads_params", base)
    loss_of(model, 0).backward()
    model.finish_grad_sync()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.scale_gradients(0.5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), grads[name] * 0.5, msg=name)
    model.zero_grad_buffer()
    assert all(p.grad is None for p in model.parameters())
    with model.no_sync():
        loss_of(model, 1).backward()
    assert all(p.grad is None for p in model.parameters()), "no_sync must not reduce"
    model.start_grad_sync()
    model.finish_grad_sync()
    assert any(p.grad is not None for p in model.parameters()), "the deferred reduction lands at finish_grad_sync"
    keys = set(model.state_dict_for_save_checkpoint())
    assert "word_embeddings.weight" in keys and "layers.1.mlp.fc2.weight" in keys, sorted(keys)[:4]
    assert not any(k.startswith("module.") for k in keys), "the adapter's keys are the model's own FQNs"
    model.broadcast_params()
    model.stop_communication()
    # calculate_per_token_loss on the model config: gradients summed over ranks, not averaged.
    summed = adapter("optim_grads", base, config=model_config(calculate_per_token_loss=True))
    averaged = adapter("optim_grads", base)
    for m in (summed, averaged):
        loss_of(m, 2).backward()
        m.finish_grad_sync()
    n = dist.get_world_size()
    for (name, a), (_, b) in zip(summed.named_parameters(), averaged.named_parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor() * n, msg=name)


@check(SUITE, world_sizes=(2,))
def bad_configs_name_the_field() -> None:
    base = tiny_gpt()
    expect_error(ValueError, "use_megatron_fsdp=True", lambda: FullyShardedDataParallel(
        model_config(), DistributedDataParallelConfig(), copy.deepcopy(base)))
    # FP8 parameters are ZeRO-3 only (Megatron-FSDP): refused as invalid elsewhere, as not built under ZeRO-3
    expect_error(ValueError, ("fp8_param_gather=True", "ZeRO-3 only", "'optim'"),
                 lambda: adapter("optim", base, fp8_param_gather=True))
    expect_error(NotImplementedError, ("fp8_param_gather=True", "TransformerEngine"),
                 lambda: adapter("optim_grads_params", base, fp8_param_gather=True))
    expect_error(NotImplementedError, "disable_bucketing=True", lambda: FullyShardedDataParallel(
        model_config(), DistributedDataParallelConfig(use_megatron_fsdp=True), copy.deepcopy(base),
        disable_bucketing=True))
    with warnings.catch_warnings(record=True) as caught:  # accepted, no effect, and said so
        warnings.simplefilter("always")
        adapter("optim", base, bucket_size=1 << 20)
    assert any("bucket_size=1048576 has no effect" in str(w.message) for w in caught), [str(w.message) for w in caught]
    expect_error(ValueError, "num_distributed_optimizer_instances=3", lambda: adapter(
        "optim", base, num_distributed_optimizer_instances=3))
    bad = DistributedDataParallelConfig(use_megatron_fsdp=True)
    bad.data_parallel_sharding_strategy = "zero3"
    expect_error(ValueError, "data_parallel_sharding_strategy='zero3'", lambda: FullyShardedDataParallel(
        model_config(), bad, copy.deepcopy(base)))
    expect_error(NotImplementedError, "pg_collection", lambda: FullyShardedDataParallel(
        model_config(), DistributedDataParallelConfig(use_megatron_fsdp=True), copy.deepcopy(base),
        pg_collection=object()))

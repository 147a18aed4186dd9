"""Small models shared by the tests: awkward on purpose.

``Net`` has parameter sizes that do not divide by 2 or 4, a parameter smaller
than the world size (zero-row shards), an embedding tied to the output layer,
a frozen layer, a block called twice per forward and a block used only under
``no_grad``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 17, 13


class Block(nn.Module):
    def __init__(self, dim: int = DIM, frozen_norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)
        self.down = nn.Linear(3 * dim + 1, dim)
        if frozen_norm:
            self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP with a ReLU (the FSDP2-scenario suites' block; ``Block`` uses tanh)."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.tiny = nn.Parameter(torch.randn(1, DIM) * 0.1)  # fewer rows than ranks
        self.blocks = nn.ModuleList([Block(frozen_norm=(i == 1)) for i in range(layers)])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.probe = Block()  # only ever run under no_grad
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.tiny
        x = self.frozen(x)
        for block in self.blocks:
            x = block(x)
        x = self.blocks[0](x)  # the same unit twice in one forward
        with torch.no_grad():
            probe = self.probe(x)
        x = x + 0.0 * probe
        return self.head(x)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_batch(step: int, world_size: int, per_rank: int = 2, seq: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)  # a CPU generator: the same tokens on every device
    tokens = torch.randint(0, VOCAB, (per_rank * world_size, seq), generator=g, device="cpu")
    return tokens.to(torch.get_default_device())  # the harness's GPU under nccl, else the CPU


def local_batch(step: int, rank: int, world_size: int, per_rank: int = 2) -> torch.Tensor:
    return global_batch(step, world_size, per_rank).chunk(world_size)[rank]

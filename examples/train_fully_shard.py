"""Train a small GPT-style transformer with ``megatron_fsdp.fully_shard``.

Run on two CPU processes (gloo) or two GPUs (NCCL, chosen when CUDA is available)::

    torchrun --nproc-per-node 2 examples/train_fully_shard.py
    torchrun --nproc-per-node 2 examples/train_fully_shard.py --sharding-strategy optim_grads

The data is synthetic with a learnable rule (next token = token + 1 mod vocab),
so the loss falls quickly. Every rank draws its own batches, as data-parallel
ranks do; the library averages the gradients.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_fsdp import STRATEGIES, comm_stats, full_tensor, fully_shard


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(hidden, dim=-1)
        # (batch, seq, hidden) -> (batch, heads, seq, head_dim), the layout SDPA expects.
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        # Tied weights: both uses live in the root module, so the root unit owns the parameter.
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's small init; PyTorch's N(0, 1) embeddings make the tied head's logits huge.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def synthetic_batch(
    generator: torch.Generator, batch: int, seq: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up mod ``vocab`` from a random start; targets are inputs shifted by one."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharding-strategy", default="optim_grads_params", choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_distributed() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main() -> None:
    args = parse_args()
    if args.hidden % args.heads:
        raise SystemExit(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    device = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    # Same seed on every rank: fully_shard keeps each rank's own rows of its
    # local initialisation, so all ranks must start from identical weights.
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())

    # Bottom-up: each block is its own unit (gathered and freed on its own);
    # the root then owns what is left (embeddings, tied head, final norm).
    for block in model.blocks:
        fully_shard(block, sharding_strategy=args.sharding_strategy)
    fully_shard(model, sharding_strategy=args.sharding_strategy)

    # Created after fully_shard, so it holds the sharded (DTensor) parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # A different data stream per rank, as in real data-parallel training.
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)

    if rank == 0:
        print(
            f"world={world} backend={dist.get_backend()} strategy={args.sharding_strategy} "
            f"params={n_params:,} initial loss ~ ln(vocab)={math.log(args.vocab):.3f}",
            flush=True,
        )
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        comm_stats.reset()
        tokens, targets = synthetic_batch(generator, args.batch_size, args.seq_len, args.vocab, device)
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        # DTensor-aware: the norm is reduced over every rank's shards.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        # Read before the logging all-reduce below (which bypasses comm_stats anyway).
        step_bytes = comm_stats.total_bytes
        by_kind = dict(comm_stats.bytes)

        if step % args.log_every == 0 or step in (1, args.steps):
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            norm = full_tensor(grad_norm).item()
            if rank == 0:
                kinds = " ".join(f"{k}={v / 1024:.1f}KiB" for k, v in sorted(by_kind.items()))
                print(
                    f"step {step:4d} | loss {mean_loss.item():.4f} | grad norm {norm:.3f} | "
                    f"comm {step_bytes / 1024:.1f} KiB/step ({kinds})",
                    flush=True,
                )
    if rank == 0:
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
    # Free finished gloo work held in reference cycles while the group still exists;
    # freed at interpreter exit it can abort the process (docs/api.md, "Shutting down").
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The runnable Python examples of README.md and docs/*.md, run on gloo ranks (the doc-test convention).

A fenced ``python`` block whose first line is ``# doc-test: ranks=N [setup=NAME]`` is run
as written on N gloo ranks, every rank executing the whole block (as under
``torchrun --nproc-per-node N``). docs/api.md ("Examples in the docs are tested") is the
reader's side of this convention. What the runner provides:

- the process group: the harness starts it (gloo; MASTER_ADDR/MASTER_PORT, RANK,
  WORLD_SIZE, LOCAL_RANK set as torchrun sets them). A block's own
  ``dist.init_process_group("gloo")`` (or with no backend) is accepted as a no-op
  and its ``destroy_process_group()`` is left to the harness; any other backend fails;
- the names the examples use for the reader's own model and data, and nothing else
  (a block imports what it uses from torch and megatron_fsdp, so a missing import
  fails): ``MyTransformer`` (a small GPT: ``.layers`` of ``Block``, ``.vision_tower``
  frozen, a 0-dim ``.logit_scale``; every parameter initialised by a
  ``reset_parameters()``, so it builds on the meta device), ``Block``, ``batch`` (this
  rank's tokens), ``data`` and ``micro_batches`` (lists of such), ``steps`` (2) and
  ``loss_fn(logits, tokens)``;
- with ``setup=model``: also ``model = MyTransformer()``, not sharded; with
  ``setup=sharded``: ``model`` sharded with ``fully_shard`` bottom-up and ``optimizer``
  (AdamW on its parameters);
- a working directory of its own, shared by the block's ranks and removed afterwards,
  for the files it writes (checkpoints).

Every block is a check of the suite ``docs`` (tests/docs/test_doc_snippets.py), named
after its file and line, so a failure points at the example.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed.harness import check, shared_tmpdir

SUITE = "docs"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
MARKER = re.compile(r"^#\s*doc-test:\s*(.*)$")
SETUPS = ("none", "model", "sharded")
VOCAB, DIM, SEQ = 64, 32, 16


@dataclass(frozen=True)
class DocBlock:
    """One marked example: where it is, how to run it, its code."""

    path: str  # relative to the repository root
    line: int  # of the opening fence
    ranks: int
    setup: str
    code: str

    @property
    def name(self) -> str:
        return re.sub(r"\W", "_", f"{self.path}_{self.line}")


def parse_marker(text: str, where: str) -> tuple[int, str]:
    """``ranks=N [setup=NAME]`` -> (N, NAME); errors name the block and the valid keys."""
    options = dict(item.split("=", 1) for item in text.split() if "=" in item)
    stray = [item for item in text.split() if "=" not in item]
    unknown = set(options) - {"ranks", "setup"}
    if stray or unknown or "ranks" not in options:
        raise ValueError(f"{where}: bad doc-test marker {text!r}; write 'ranks=N' and optionally 'setup=NAME'")
    if not options["ranks"].isdigit() or int(options["ranks"]) < 1:
        raise ValueError(f"{where}: doc-test ranks={options['ranks']!r} must be a positive integer")
    setup = options.get("setup", "none")
    if setup not in SETUPS:
        raise ValueError(f"{where}: doc-test setup={setup!r} is not one of {SETUPS}")
    return int(options["ranks"]), setup


def python_blocks(path: str) -> Iterator[tuple[int, list[str]]]:
    """(line of the opening fence, body lines) of every fenced ``python`` block of ``path``."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            yield start + 1, lines[start + 1:i]
        i += 1


def marked_blocks() -> list[DocBlock]:
    """Every block of README.md and docs/*.md that carries a doc-test marker."""
    blocks = []
    for path in DOC_FILES:
        for line, body in python_blocks(path):
            found = MARKER.match(body[0].strip()) if body else None
            if found:
                ranks, setup = parse_marker(found.group(1), f"{path}:{line}")
                blocks.append(DocBlock(path, line, ranks, setup, "\n".join(body) + "\n"))
    return blocks


# -- what the examples call the reader's model and data -------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer layer (causal self-attention, MLP) of Linear and LayerNorm only."""

    def __init__(self, dim: int = DIM, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class MyTransformer(nn.Module):
    """A small GPT: token embedding, ``layers``, a frozen ``vision_tower``, a 0-dim ``logit_scale``."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vision_tower = nn.Linear(DIM, DIM).requires_grad_(False)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.logit_scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.logit_scale.fill_(1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.vision_tower(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) * self.logit_scale


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def fixtures(setup: str) -> dict[str, object]:
    """A fresh namespace for one block (see the module docstring)."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = [torch.randint(0, VOCAB, (2, SEQ), generator=generator) for _ in range(4)]
    namespace: dict[str, object] = {
        "__name__": "__doc_test__", "MyTransformer": MyTransformer, "Block": Block, "loss_fn": loss_fn,
        "batch": tokens[0], "data": tokens[:3], "micro_batches": tokens[2:], "steps": 2,
    }
    if setup in ("model", "sharded"):
        namespace["model"] = model = MyTransformer()
    if setup == "sharded":
        from megatron_fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        namespace["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return namespace


@contextlib.contextmanager
def harness_process_group() -> Iterator[None]:
    """The block's own start/stop of the process group: accepted, the harness's group is used."""
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend: str | None = None, *args: object, **kwargs: object) -> None:
        backend = kwargs.get("backend", backend)
        if backend not in (None, "gloo", "cpu:gloo"):
            raise RuntimeError(f"doc-tests run on gloo (CPU); the block asked for backend {backend!r}")

    def destroy_process_group(group: object = None) -> None:
        if group is not None:
            real_destroy(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy


def run_block(block: DocBlock) -> None:
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(dist.get_world_size()))
    namespace = fixtures(block.setup)
    cwd = os.getcwd()
    # Files a block writes (checkpoints) land in a directory of its own, shared by its ranks.
    with shared_tmpdir("mfsdp_doc_") as workdir, harness_process_group():
        os.chdir(workdir)
        try:
            exec(compile(block.code, f"{block.path}:{block.line}", "exec"), namespace)
        finally:
            os.chdir(cwd)


def _register(block: DocBlock) -> None:
    def run() -> None:
        run_block(block)

    run.__name__ = block.name
    check(SUITE, world_sizes=(block.ranks,))(run)


BLOCKS = marked_blocks()
WORLD_SIZES = tuple(sorted({b.ranks for b in BLOCKS}))
for _block in BLOCKS:
    _register(_block)

"""Per-rank micro-batch iterators in Megatron's sample order (``MegatronPretrainingSampler``).

Iteration ``i`` trains on samples ``[i * G, (i + 1) * G)`` of the train dataset (``G`` =
``--global-batch-size``), counted from the start of training. The global batch is walked in
groups of ``micro_batch_size * dp_size`` consecutive samples; group ``m`` is micro-batch ``m`` of
the step, and rank ``r`` takes the ``r``-th run of ``micro_batch_size`` samples of it. The set of
samples in a global batch therefore does not depend on the number of ranks, and a run resumed
from ``consumed_train_samples`` at any data-parallel size continues with the same samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .datasets.builder import build_train_valid_test_datasets, parse_data_path, train_valid_test_num_samples
from .datasets.indexed_dataset import IndexedDataset
from .tokenizer import build_tokenizer


class MegatronPretrainingSampler:
    """Yields, for one data-parallel rank, the sample indices of each of its micro-batches."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is not in [0, {dp_size}) (data-parallel size {dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed samples {consumed_samples} outside the dataset's [0, {total_samples}] samples "
                "(resuming past the end of the data?)"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.group = self.micro_batch_size * int(dp_size)

    def __len__(self) -> int:
        """Micro-batches this rank will yield (partial final groups are dropped)."""
        return (self.total_samples - self.consumed_samples) // self.group

    def __iter__(self) -> Iterator[list[int]]:
        start = self.dp_rank * self.micro_batch_size
        for group_start in range(self.consumed_samples, self.total_samples - self.group + 1, self.group):
            first = group_start + start
            yield list(range(first, first + self.micro_batch_size))


def check_batch_sizes(args: Any, dp_size: int) -> None:
    """Raise ValueError unless the global batch splits into whole micro-batches on every rank."""
    mbs, gbs = int(args.micro_batch_size), int(args.global_batch_size)
    if mbs < 1 or gbs < 1:
        raise ValueError(f"--micro-batch-size ({mbs}) and --global-batch-size ({gbs}) must be >= 1")
    if gbs % (mbs * dp_size) != 0:
        raise ValueError(
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({mbs}) times the "
            f"data-parallel size ({dp_size}) = {mbs * dp_size}"
        )


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
    num_workers: int = 0, total_samples: int | None = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader yielding this rank's micro-batches (dicts of ``[micro_batch_size, seq]`` tensors).

    It stops after sample ``total_samples`` (default: the dataset's length); a GPT dataset holds
    whole epochs, so it is usually longer than what training asks for.
    """
    total = len(dataset) if total_samples is None else min(int(total_samples), len(dataset))
    if consumed_samples % (micro_batch_size * dp_size) != 0:
        raise ValueError(
            f"consumed samples {consumed_samples} is not a multiple of --micro-batch-size ({micro_batch_size}) "
            f"times the data-parallel size ({dp_size}); resume from a checkpoint taken at a step boundary"
        )
    sampler = MegatronPretrainingSampler(total, consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=int(num_workers),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=int(num_workers) > 0,
        # Its own generator: starting an iterator draws a worker base seed, and from the global
        # torch RNG that draw would shift dropout masks after a checkpoint's RNG state is restored.
        generator=torch.Generator().manual_seed(0),
    )


def check_data_files(args: Any) -> None:
    """Open every ``--data-path`` prefix once (missing or truncated files raise, naming the file).

    Costs milliseconds (the index is memory-mapped and checked, no token read), so the
    front-end calls it before building the model rather than finding the fault after it.
    """
    if getattr(args, "mock_data", False) or not getattr(args, "data_path", None):
        return
    prefixes, _ = parse_data_path(args.data_path)
    for prefix in prefixes:
        IndexedDataset(prefix)


def check_token_ids(batches: Iterable[dict], vocab_size: int, source: str) -> Iterator[dict]:
    """Yield ``batches``, first checking that every token and label id is in ``[0, vocab_size)``.

    An id outside the tokenizer's vocabulary means the data was tokenized with another tokenizer
    or vocabulary size; the embedding would fail with a bare ``IndexError`` (or, below the padded
    vocabulary, silently train on a wrong id). A min and a max per CPU micro-batch cost nothing
    next to a forward pass.
    """
    for batch in batches:
        for key in ("tokens", "labels"):
            ids = batch[key]
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab_size:
                bad = high if high >= vocab_size else low
                raise ValueError(
                    f"{source}: token id {bad} is outside the tokenizer's vocabulary [0, {vocab_size}); the data "
                    "and the tokenizer disagree. Train with the tokenizer the data was preprocessed with "
                    "(--tokenizer-type, --tokenizer-model; for NullTokenizer a --vocab-size above every id in the "
                    "data), or preprocess the data again with this one"
                )
        yield batch


def build_train_valid_test_data_iterators(
    args: Any, dp_rank: int, dp_size: int, tokenizer: Any = None, *, consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
) -> tuple[Iterator | None, Iterator | None, Iterator | None]:
    """Train, validation and test micro-batch iterators for one data-parallel rank.

    Each ``next()`` is one micro-batch: ``tokens``, ``labels``, ``position_ids`` (int64) and
    ``loss_mask`` (float32), all ``[micro_batch_size, seq_length]``. Train starts at
    ``consumed_train_samples``, validation at ``consumed_valid_samples`` (a resumed run's position), test at 0.
    Each iterator ends after its split's samples (train: ``train_iters * global_batch_size``;
    validation: ``(train_iters // eval_interval + 1) * eval_iters * global_batch_size``; test:
    ``eval_iters * global_batch_size``). An iterator is None when its split has no documents or
    no samples are asked of it. Every batch's ids are checked against the tokenizer's vocabulary
    (``check_token_ids``). ``tokenizer`` defaults to ``build_tokenizer(args)``.
    """
    check_batch_sizes(args, dp_size)
    if not getattr(args, "mock_data", False) and not getattr(args, "data_path", None):
        raise ValueError("no training data: give --data-path PREFIX (a .bin/.idx pair) or --mock-data")
    if tokenizer is None:
        tokenizer = build_tokenizer(args)
    datasets = build_train_valid_test_datasets(args, tokenizer)
    wanted = train_valid_test_num_samples(args)
    consumed = (int(consumed_train_samples), int(consumed_valid_samples), 0)
    num_workers = int(getattr(args, "num_workers", 0) or 0)
    path = getattr(args, "data_path", None) or []
    path = path if isinstance(path, str) else " ".join(path)
    data = "--mock-data" if getattr(args, "mock_data", False) else f"--data-path {path}"
    iterators: list[Iterator | None] = []
    for dataset, start, total, split in zip(datasets, consumed, wanted, ("train", "validation", "test")):
        if dataset is None:
            iterators.append(None)
            continue
        loader = build_pretraining_data_loader(
            dataset, start, int(args.micro_batch_size), dp_rank, dp_size, num_workers, total
        )
        iterators.append(check_token_ids(loader, tokenizer.vocab_size, f"{data} ({split} split)"))
    return iterators[0], iterators[1], iterators[2]

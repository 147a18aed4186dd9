"""Turn Megatron's data flags into train / validation / test datasets.

``--data-path`` is one prefix (``PREFIX.bin``/``PREFIX.idx``), several prefixes (blended in
proportion to their token counts), or Megatron's weighted list ``W1 PREFIX1 W2 PREFIX2 ...``.
``--split "969,30,1"`` cuts every prefix's documents, in file order, into contiguous train,
validation and test ranges in those proportions. ``--mock-data`` uses synthetic documents instead
(split the same way). A split with no documents, or for which no samples are asked, gives None.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch

from .blended_dataset import BlendedDataset, normalize_weights, samples_per_dataset
from .gpt_dataset import GPTDataset, LowLevelDataset
from .indexed_dataset import IndexedDataset, check_dataset_files
from .mock_dataset import MockLowLevelDataset

SPLIT_NAMES = ("train", "valid", "test")
_NUMBER = re.compile(r"^\s*\d+(\.\d*)?\s*$|^\s*\.\d+\s*$")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, 1 to 3 numbers, missing ones 0) as fractions summing to 1."""
    parts = re.split(r"[,/]", split) if isinstance(split, str) else None
    if not parts or len(parts) > 3 or not all(_NUMBER.match(p) for p in parts):
        raise ValueError(
            f"--split {split!r} is not valid: give 1 to 3 non-negative numbers separated by ',' or '/' "
            "(train,valid,test weights), e.g. \"969,30,1\""
        )
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0; at least one must be positive")
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(split: list[float], num_documents: int) -> list[tuple[int, int]]:
    """``[beg, end)`` document ranges per split, as megatron-core rounds cumulative fractions."""
    ranges = []
    low = 0.0
    for fraction in split:
        high = low + fraction
        ranges.append((int(round(low * num_documents)), int(round(high * num_documents))))
        low = high
    # the float sum may fall short of 1.0; the last non-empty range owns the tail
    last = max(i for i, f in enumerate(split) if f > 0)
    ranges[last] = (ranges[last][0], num_documents)
    return ranges


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Prefixes and weights (None when unweighted) from a ``--data-path`` list."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    if not data_path:
        raise ValueError("--data-path is empty: give PREFIX, or W1 PREFIX1 W2 PREFIX2 ..., or use --mock-data")
    if len(data_path) == 1:
        return list(data_path), None
    pairs = len(data_path) % 2 == 0 and all(_is_float(data_path[i]) for i in range(0, len(data_path), 2))
    if not pairs:
        if any(_is_float(p) for p in data_path):
            raise ValueError(
                f"--data-path {' '.join(data_path)}: mixes numbers and prefixes; give either PREFIX ... or "
                "W1 PREFIX1 W2 PREFIX2 ... (a weight before every prefix)"
            )
        return list(data_path), None
    weights = [float(data_path[i]) for i in range(0, len(data_path), 2)]
    prefixes = [data_path[i] for i in range(1, len(data_path), 2)]
    return prefixes, normalize_weights(weights)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def train_valid_test_num_samples(args: Any) -> tuple[int, int, int]:
    """Samples each split must provide, as Megatron computes them from the iteration flags."""
    gbs = int(args.global_batch_size)
    train_iters = int(args.train_iters)
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    eval_interval = getattr(args, "eval_interval", None)
    evals = train_iters // int(eval_interval) + 1 if eval_interval else 1
    return train_iters * gbs, evals * eval_iters * gbs, eval_iters * gbs


def _split_datasets(
    low_level: LowLevelDataset, name: str, split: list[float], sizes: list[int | None], args: Any, eod: int
) -> list[GPTDataset | None]:
    """One GPTDataset per split of one low-level dataset (None for empty or unrequested splits)."""
    ranges = split_document_ranges(split, len(low_level.sequence_lengths))
    out: list[GPTDataset | None] = []
    for split_name, (beg, end), size in zip(SPLIT_NAMES, ranges, sizes):
        if end <= beg or size == 0:
            out.append(None)
            continue
        try:
            out.append(
                GPTDataset(
                    low_level,
                    np.arange(beg, end, dtype=np.int64),
                    size,
                    int(args.seq_length),
                    int(args.seed),
                    eod,
                    bool(getattr(args, "eod_mask_loss", False)),
                )
            )
        except ValueError as error:
            raise ValueError(f"{name}, {split_name} split (documents [{beg}, {end})): {error}") from None
    return out


def build_train_valid_test_datasets(
    args: Any, tokenizer: Any
) -> tuple[torch.utils.data.Dataset | None, torch.utils.data.Dataset | None, torch.utils.data.Dataset | None]:
    """The three datasets for ``args`` (see the module docstring); None where a split is empty."""
    split = parse_split(getattr(args, "split", None) or "969,30,1")
    sizes = list(train_valid_test_num_samples(args))
    if getattr(args, "mock_data", False):
        body_vocab = tokenizer.eod if tokenizer.eod == tokenizer.vocab_size - 1 else tokenizer.vocab_size
        mock = MockLowLevelDataset(body_vocab, tokenizer.eod, int(args.seq_length))
        return tuple(_split_datasets(mock, "--mock-data", split, sizes, args, tokenizer.eod))

    prefixes, weights = parse_data_path(getattr(args, "data_path", None))
    for prefix in prefixes:
        check_dataset_files(prefix)
    low_levels = [IndexedDataset(prefix) for prefix in prefixes]
    if len(prefixes) == 1:
        return tuple(_split_datasets(low_levels[0], f"--data-path {prefixes[0]}", split, sizes, args, tokenizer.eod))

    if weights is None:  # unweighted list: weigh each prefix by its token count
        weights = normalize_weights([float(np.asarray(ds.sequence_lengths, dtype=np.int64).sum()) for ds in low_levels])
    blends: list[BlendedDataset | None] = []
    for s in range(len(SPLIT_NAMES)):
        # prefixes whose share of this split holds documents; the blend's weights renormalize over them
        members = [
            d
            for d, ds in enumerate(low_levels)
            if weights[d] > 0 and _nonempty(split_document_ranges(split, len(ds.sequence_lengths))[s])
        ]
        if not members or sizes[s] == 0:
            blends.append(None)
            continue
        member_weights = normalize_weights([weights[d] for d in members])
        member_sizes = samples_per_dataset(member_weights, sizes[s])
        datasets = []
        for d, size in zip(members, member_sizes):
            split_sizes: list[int | None] = [0, 0, 0]
            split_sizes[s] = size
            name = f"--data-path {prefixes[d]}"
            datasets.append(_split_datasets(low_levels[d], name, split, split_sizes, args, tokenizer.eod)[s])
        # megatron-core's blend length: each member's ceil share (>= the samples asked for)
        blend_size = sum(math.ceil(sizes[s] * w) for w in member_weights)
        blends.append(BlendedDataset(datasets, member_weights, blend_size))
    return tuple(blends)


def _nonempty(document_range: tuple[int, int]) -> bool:
    return document_range[1] > document_range[0]

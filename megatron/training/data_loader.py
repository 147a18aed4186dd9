"""Train / validation / test data for ``pretrain_gpt.py``: megatron-core's datasets, Megatron's sampler.

The datasets are megatron-core's, built as Megatron-LM's ``pretrain_gpt.py`` builds them
(``train_valid_test_datasets_provider``): a ``GPTDatasetConfig`` from the flags
(``core_gpt_dataset_config_from_args``) handed to ``BlendedMegatronDatasetBuilder`` with
``GPTDataset`` (``--data-path``: megatron-core's ``IndexedDataset`` files, split by ``--split``,
blended by weight or size) or ``MockGPTDataset`` (``--mock-data``). So the same ``--data-path``,
``--split``, ``--seed`` and iteration flags give the samples of Megatron-LM, in its order. What
the front-end adds around it:

* checks before the builder: missing or truncated ``.bin``/``.idx`` files name the file
  (``check_data_files``), and a split that receives no tokens while samples are asked of it
  fails naming ``--split`` (megatron-core's builder would repeat an empty epoch forever);
* ``--mock-data`` keeps this project's synthetic corpus (``MockCorpus``: learnable arithmetic
  documents; megatron-core's mock documents are ``1, 2, 3, ...`` up to 4,096 tokens) and honours
  ``--split`` (megatron-core's mock data always splits 1,1,1): the functional goldens are
  recorded on it. It is read through megatron-core's ``MockGPTDataset`` all the same;
* Megatron's ``MegatronPretrainingSampler`` (it lives in Megatron-LM's training code, not in
  megatron-core): iteration ``i`` trains on samples ``[i * G, (i + 1) * G)`` of the train dataset
  (``G`` = ``--global-batch-size``), walked in groups of ``micro_batch_size * dp_size``
  consecutive samples; group ``m`` is micro-batch ``m`` of the step, and rank ``r`` takes the
  ``r``-th run of ``micro_batch_size`` samples of it. The samples of a global batch therefore
  do not depend on the number of ranks, and a run resumed from ``consumed_train_samples`` at any
  data-parallel size continues with the same samples;
* every batch's token ids are checked against the tokenizer's vocabulary (``check_token_ids``).

Every rank builds the datasets (one pipeline stage: each tensor- and context-parallel rank reads
its own copy rather than receiving a broadcast from tensor-parallel rank 0, as Megatron-LM does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import get_blend_from_list

from .arguments import parse_split
from .errors import UsageValueError
from .tokenizer import build_tokenizer

SPLIT_NAMES = ("train", "validation", "test")


class _MockIndicesNotCached(logging.Filter):
    """Drops megatron-core's warning that mock-data indices are not cached: they never are (nothing to say)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "indexes because path_to_cache is None" not in record.getMessage()


logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(_MockIndicesNotCached())


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



# --mock-data: this project's corpus (see the module docstring)
MOCK_NUM_DOCUMENTS = 100_000  # megatron-core's mock corpus size
MOCK_CONTENT_SEED = 1234
MOCK_MAX_STRIDE = 3


class MockCorpus:
    """``num_documents`` synthetic documents: ids in ``[0, body_vocab_size)``, each ended by ``eod``.

    Document ``d`` is an arithmetic sequence modulo the body vocabulary ``V`` followed by ``eod``
    (``a, a+b, a+2b, ... (mod V), eod``), with ``a`` uniform in ``[0, V)``, ``b`` in
    ``[1, MOCK_MAX_STRIDE]`` and the length (eod included) in ``[max(2, seq_length // 2),
    2 * seq_length]``, all drawn up front from one generator seeded with ``MOCK_CONTENT_SEED``.
    The corpus is fixed; ``--seed`` shuffles it, as it shuffles real data. Inside a document the
    next token follows from the previous two, so a small GPT's loss falls quickly from ``ln(V)``.
    It has what megatron-core's ``GPTDataset`` reads of a low-level dataset: ``sequence_lengths``
    (int32), ``len()`` and ``get(idx, offset, length)``.
    """

    def __init__(self, body_vocab_size: int, eod: int, seq_length: int,
                 num_documents: int = MOCK_NUM_DOCUMENTS) -> None:
        if body_vocab_size < 1:
            raise ValueError(f"mock data needs a vocabulary of at least 1 id, got {body_vocab_size}")
        self.body_vocab_size, self.eod = int(body_vocab_size), int(eod)
        rng = np.random.default_rng([MOCK_CONTENT_SEED, 0])
        low, high = max(2, seq_length // 2), max(2, 2 * seq_length)
        self.sequence_lengths = rng.integers(low, high + 1, size=num_documents).astype(np.int32)
        self.starts = rng.integers(0, self.body_vocab_size, size=num_documents)
        self.strides = rng.integers(1, MOCK_MAX_STRIDE + 1, size=num_documents)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx`` (to its end when length is None)."""
        size = int(self.sequence_lengths[idx])
        body = int(self.starts[idx]) + int(self.strides[idx]) * np.arange(size - 1, dtype=np.int64)
        document = np.append(body % self.body_vocab_size, self.eod).astype(np.int64)
        return document[offset:size if length is None else offset + length]


class MockDataset(MockGPTDataset):
    """megatron-core's ``MockGPTDataset`` over ``MockCorpus`` (its vocabulary and eod from the tokenizer)."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> MockCorpus:
        tokenizer = config.tokenizer
        # the eod id is the last id of a NullTokenizer's vocabulary: the body stays below it
        body = tokenizer.eod if tokenizer.eod == tokenizer.vocab_size - 1 else tokenizer.vocab_size
        return MockCorpus(body, tokenizer.eod, config.sequence_length)


def train_valid_test_num_samples(args: Any) -> tuple[int, int, int]:
    """Samples each split must provide, as Megatron-LM computes them from the iteration flags."""
    gbs = int(args.global_batch_size)
    train_iters = int(args.train_iters)
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    eval_interval = getattr(args, "eval_interval", None)
    evals = train_iters // int(eval_interval) + 1 if eval_interval else 1
    return train_iters * gbs, evals * eval_iters * gbs, eval_iters * gbs


def _data_path_list(args: Any) -> list[str]:
    data_path = getattr(args, "data_path", None)
    return data_path.split() if isinstance(data_path, str) else list(data_path or [])


def data_prefixes(args: Any) -> list[str]:
    """The dataset prefixes of ``--data-path`` (megatron-core's ``get_blend_from_list``); [] with --mock-data."""
    if getattr(args, "mock_data", False):
        return []
    data_path = _data_path_list(args)
    if not data_path:
        raise UsageValueError("--data-path is empty: give PREFIX, or W1 PREFIX1 W2 PREFIX2 ..., or use --mock-data")
    prefixes, weights = get_blend_from_list(data_path)
    if weights is None and len(data_path) > 1 and any(_is_number(p) for p in data_path):
        raise UsageValueError(
            f"--data-path {' '.join(data_path)}: mixes numbers and prefixes; give either PREFIX ... or "
            "W1 PREFIX1 W2 PREFIX2 ... (a weight before every prefix)"
        )
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise UsageValueError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    return list(prefixes)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_dataset_files(prefix: str) -> IndexedDataset:
    """megatron-core's ``IndexedDataset`` of ``prefix``, after checks that name the faulty file.

    A missing file raises FileNotFoundError; an index megatron-core cannot read, or a ``.bin``
    shorter than its index says, ValueError ("truncated or corrupt"). Vectorised over the index
    (no token is read), so it costs milliseconds; without it a cut file fails only when training
    reaches the cut document.
    """
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"--data-path {prefix}: missing {path} (an indexed dataset is a PREFIX.bin/PREFIX.idx pair, "
                "written by tools/preprocess_data.py or Megatron-LM's preprocess_data.py)"
            )
    try:  # mmap=False: the .bin is not mapped yet (an empty one cannot be), so its size is checked first
        dataset = IndexedDataset(prefix, multimodal=False, mmap=False)
    except Exception as error:  # megatron-core asserts, or numpy/struct fail, on a cut or foreign index
        raise ValueError(
            f"{idx_path} is truncated or corrupt: megatron-core's IndexedDataset cannot read it "
            f"({type(error).__name__}: {error}); copy or preprocess the dataset again (tools/preprocess_data.py)"
        ) from None
    lengths, pointers = dataset.index.sequence_lengths, dataset.index.sequence_pointers
    if len(lengths):
        ends = pointers + lengths.astype(np.int64) * np.dtype(dataset.index.dtype).itemsize
        last = int(np.argmax(ends))
        size = os.path.getsize(bin_path)
        if int(ends[last]) > size:
            raise ValueError(
                f"{bin_path} is truncated or corrupt: it holds {size} bytes, {int(ends[last])} are needed for "
                f"sequence {last} (per its .idx); copy or preprocess the dataset again (tools/preprocess_data.py)"
            )
    return dataset


def check_data_files(args: Any) -> None:
    """Check every ``--data-path`` prefix's files (``check_dataset_files``); nothing with --mock-data.

    The front-end calls it before building the model rather than finding the fault after it.
    """
    for prefix in data_prefixes(args):
        check_dataset_files(prefix)


def core_gpt_dataset_config_from_args(args: Any, tokenizer: Any) -> GPTDatasetConfig:
    """megatron-core's ``GPTDatasetConfig`` for the flags, as Megatron-LM's ``pretrain_gpt.py`` makes it.

    ``--mock-data``: megatron-core sets the split to ``1,1,1`` for mock data; the front-end puts
    ``--split`` back (see the module docstring).
    """
    prefixes = data_prefixes(args)
    split = getattr(args, "split", None) or "969,30,1"
    parse_split(split)  # the user-facing check: megatron-core's parser reads whatever digits it finds
    config = GPTDatasetConfig(
        random_seed=int(args.seed),
        sequence_length=int(args.seq_length),
        blend=get_blend_from_list(_data_path_list(args)) if prefixes else None,
        split=split,
        path_to_cache=getattr(args, "data_cache_path", None),
        mmap_bin_files=True,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=False,
    )
    if config.mock:
        config.split = split
        config.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return config


def _data_description(args: Any) -> str:
    if getattr(args, "mock_data", False):
        return "--mock-data"
    path = args.data_path
    return f"--data-path {path if isinstance(path, str) else ' '.join(path)}"


def empty_train_split_message(args: Any) -> str:
    """The error for a ``--split`` that gives the train split no documents."""
    return (f"--split {args.split} leaves the train split of {_data_description(args)} without documents: "
            "nothing to train on. Give the first (train) weight of --split a larger share, e.g. --split 969,30,1, "
            "or use a dataset with more documents")


def guard_empty_splits(args: Any, config: GPTDatasetConfig, cls: type, sizes: list[int]) -> None:
    """Drop (from ``config.split_matrix``) splits no samples are asked of; refuse a split without tokens.

    megatron-core's ``GPTDataset`` adds epochs until a split's tokens cover the samples asked of
    it, so a split whose documents hold no tokens (50 documents with ``--split 969,30,1`` leave
    the test split none) would loop forever. This looks at each low-level dataset's documents as
    megatron-core's builder cuts them (``round(fraction * documents)``) before it runs: an empty
    train split stops naming ``--split``; an empty validation or test split of a single dataset is
    dropped (no evaluation; ``pretrain`` warns); in a blend, where megatron-core would need every
    member's share, it stops naming the prefix.
    """
    matrix = config.split_matrix
    for i, size in enumerate(sizes):
        if not size:
            matrix[i] = None
    prefixes = [None] if config.mock else config.blend[0]
    for prefix in prefixes:
        low_level = cls.build_low_level_dataset(prefix, config)
        lengths = np.asarray(low_level.sequence_lengths, dtype=np.int64)
        count = len(lengths)
        for i, bounds in enumerate(matrix):
            if bounds is None:
                continue
            beg, end = int(round(bounds[0] * count)), int(round(bounds[1] * count))
            if lengths[beg:end].sum() > 0:
                continue
            if i == 0:
                raise UsageValueError(empty_train_split_message(args))
            if len(prefixes) > 1:
                raise UsageValueError(
                    f"--split {args.split} leaves the {SPLIT_NAMES[i]} split of --data-path {prefix} without tokens "
                    f"(documents [{beg}, {end}) of {count}); megatron-core blends every prefix's share of a split, "
                    f"so each needs some. Give that split a larger share of --split, or drop it (weight 0)"
                )
            matrix[i] = None


def build_train_valid_test_datasets(args: Any, tokenizer: Any) -> list[torch.utils.data.Dataset | None]:
    """megatron-core's train, validation and test datasets for the flags (None: a split not built).

    Megatron-LM's ``train_valid_test_datasets_provider``: ``BlendedMegatronDatasetBuilder`` with
    ``GPTDataset`` (``MockDataset`` for ``--mock-data``) and the config of
    ``core_gpt_dataset_config_from_args``, after ``guard_empty_splits``. A split is None when
    ``--split`` gives it weight 0, no samples are asked of it, or (validation and test of a single
    dataset) it holds no documents. Call it on every rank (megatron-core's builder meets the
    others at barriers when a process group is initialized).
    """
    sizes = list(train_valid_test_num_samples(args))
    for prefix in data_prefixes(args):
        check_dataset_files(prefix)
    config = core_gpt_dataset_config_from_args(args, tokenizer)
    cls = MockDataset if config.mock else GPTDataset
    guard_empty_splits(args, config, cls, sizes)
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


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
    no samples are asked of it
    (``build_train_valid_test_datasets``). Every batch's ids are checked against the tokenizer's vocabulary
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
    data = _data_description(args)
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

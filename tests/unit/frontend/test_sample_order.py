"""Megatron-LM's sample order: what pretrain_gpt.py's data path yields equals megatron-core built directly.

A dataset is written by tools/preprocess_data.py (and a second one by megatron-core's own
``IndexedDatasetBuilder``); the first batches of ``build_train_valid_test_data_iterators`` for a
``--data-path`` (one prefix, and the two blended by weight) with ``--split``/``--seed`` must equal,
exactly, the samples of megatron-core's ``GPTDataset`` (and ``BlendedDataset``) built here with the
``GPTDatasetConfig`` Megatron-LM's pretrain_gpt.py makes from the same flags: tokens, labels,
loss_mask and position_ids, in order, at one and at two data-parallel ranks.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron.training.data_loader import build_train_valid_test_data_iterators
from megatron.training.tokenizer import build_tokenizer
from tests import ROOT

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _args(**overrides) -> argparse.Namespace:
    args = dict(mock_data=False, data_path=None, split="90,8,2", seq_length=16, micro_batch_size=2,
                global_batch_size=8, train_iters=12, eval_iters=2, eval_interval=4, seed=1234, vocab_size=None,
                tokenizer_type="ByteTokenizer", tokenizer_model=None, eod_mask_loss=False, num_workers=0,
                data_cache_path=None)
    args.update(overrides)
    return argparse.Namespace(**args)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    """``a``: 300 JSONL documents through tools/preprocess_data.py (ByteTokenizer); ``b``: 120 documents written
    by megatron-core's IndexedDatasetBuilder."""
    tmp = tmp_path_factory.mktemp("order")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "ünï", "✓", "x", "42"]
    with open(tmp / "a.jsonl", "w", encoding="utf-8") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(1, 12))))}) + "\n")
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    run = subprocess.run([sys.executable, tool, "--input", str(tmp / "a.jsonl"), "--output-prefix", str(tmp / "a"),
                          "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    builder = IndexedDatasetBuilder(str(tmp / "b.bin"), dtype=np.uint16)
    for _ in range(120):
        builder.add_item(torch.tensor(rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist() + [256]))
        builder.end_document()
    builder.finalize(str(tmp / "b.idx"))
    return str(tmp / "a_text_document"), str(tmp / "b")


def _megatron_lm_config(args: argparse.Namespace, cache: str | None) -> GPTDatasetConfig:
    """The config Megatron-LM's pretrain_gpt.py (core_gpt_dataset_config_from_args) makes from these flags."""
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        split=args.split, path_to_cache=cache, tokenizer=build_tokenizer(args), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=args.eod_mask_loss, create_attention_mask=False,
        mmap_bin_files=True,
    )


def _first_batches(args: argparse.Namespace, dp_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` samples of the train split in training order, from every rank's micro-batches."""
    per_rank = [build_train_valid_test_data_iterators(args, rank, dp_size)[0] for rank in range(dp_size)]
    samples: list[dict[str, torch.Tensor]] = []
    while len(samples) < count:
        for iterator in per_rank:  # one micro-batch group: rank 0's micro-batch, then rank 1's, ...
            batch = next(iterator)
            samples += [{k: batch[k][row] for k in KEYS} for row in range(args.micro_batch_size)]
    return samples[:count]


def _assert_equal(ours: list[dict[str, torch.Tensor]], theirs) -> None:
    for i, sample in enumerate(ours):
        reference = theirs[i]
        for key in KEYS:
            assert sample[key].dtype == reference[key].dtype, (i, key)
            assert torch.equal(sample[key], reference[key]), (i, key)


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("seed,split,eod_mask", [(1234, "90,8,2", False), (7, "80,15,5", True)])
def test_one_prefix_equals_megatron_cores_gpt_dataset(prefixes, tmp_path, dp_size, seed, split, eod_mask):
    args = _args(data_path=[prefixes[0]], seed=seed, split=split, eod_mask_loss=eod_mask,
                 data_cache_path=str(tmp_path / "ours"))
    ours = _first_batches(args, dp_size, 48)
    config = _megatron_lm_config(args, str(tmp_path / "theirs"))
    low_level = IndexedDataset(prefixes[0], multimodal=False, mmap=True)
    end = int(round(config.split_matrix[0][1] * len(low_level)))
    theirs = GPTDataset(low_level, prefixes[0], np.arange(0, end, dtype=np.int32),
                        args.train_iters * args.global_batch_size, Split.train, config)
    _assert_equal(ours, theirs)
    assert int(ours[0]["tokens"].max()) < 257  # bytes and the eod id


@pytest.mark.parametrize("dp_size", [1, 2])
def test_weighted_blend_equals_megatron_cores_builder(prefixes, tmp_path, dp_size):
    args = _args(data_path=["0.3", prefixes[0], "0.7", prefixes[1]], seed=99, train_iters=20)
    ours = _first_batches(args, dp_size, 80)
    sizes = [20 * 8, (20 // 4 + 1) * 2 * 8, 2 * 8]  # Megatron-LM's train_valid_test_num_samples
    theirs, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True,
                                                 _megatron_lm_config(args, None)).build()
    assert {int(d) for d in theirs.dataset_index[:80]} == {0, 1}  # both prefixes among the first samples
    _assert_equal(ours, theirs)

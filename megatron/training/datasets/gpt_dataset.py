"""GPT pretraining samples cut from a token stream of concatenated documents, as megatron-core does.

Three index arrays, all built from one ``numpy.random.RandomState(seed)`` so a seed fixes the data:

* document index: the split's documents, repeated for as many epochs as the requested samples
  need, shuffled (the last epoch is shuffled on its own when less than 80% of it is used, so a
  partial epoch does not mix into the full ones: megatron-core's ``separate_final_epoch``);
* sample index: where each sample starts in that stream, as (position in document index, offset).
  Sample ``i`` covers stream tokens ``[i * seq_length, i * seq_length + seq_length]``, i.e.
  ``seq_length + 1`` tokens, so consecutive samples share one boundary token and cross document
  boundaries freely;
* shuffle index: a permutation of the samples.

``tokens = s[:-1]``, ``labels = s[1:]``. With ``eod_mask_loss`` the loss mask is 0 where the input
token is end-of-document (megatron-core masks on ``tokens == eod``), else 1 everywhere.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

# megatron-core's threshold for shuffling the final, partly used epoch separately
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


class LowLevelDataset(Protocol):
    """What a GPT dataset reads from: an ``IndexedDataset`` or a mock one."""

    sequence_lengths: np.ndarray

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """The documents repeated ``num_epochs`` times and shuffled (final epoch separately if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int64), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` array of (document-index position, offset) where each sample starts.

    Equivalent to megatron-core's ``build_sample_idx`` helper (boundary token shared between
    consecutive samples, zero-length documents skipped), computed with a searchsorted.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    num_samples = (total - 1) // seq_length if total > 0 else 0
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(starts, positions, side="right") - 1
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = doc_pos
    sample_index[:, 1] = positions - starts[doc_pos]
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, total_size)``; the first ``num_samples`` and the rest shuffled separately."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length GPT samples over a subset of a low-level dataset's documents.

    Args:
        dataset: the low-level dataset (each of its sequences is one document).
        documents: indices of the documents of this split.
        num_samples: samples wanted; the epochs repeat until there are at least that many
            (None: one epoch). ``len()`` can exceed it, as in megatron-core.
        seq_length: tokens per sample (each sample reads ``seq_length + 1`` tokens).
        seed: seed of the document and sample shuffles.
        eod: end-of-document id (for the loss mask).
        eod_mask_loss: zero the loss mask where the input token is ``eod``.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        documents: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        eod: int,
        eod_mask_loss: bool = False,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        self.dataset = dataset
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.eod = int(eod)
        self.eod_mask_loss = bool(eod_mask_loss)
        tokens_per_epoch = int(np.asarray(dataset.sequence_lengths, dtype=np.int64)[self.documents].sum())
        if tokens_per_epoch <= self.seq_length:
            raise ValueError(
                f"{len(self.documents)} documents hold {tokens_per_epoch} tokens: too few for one sample of "
                f"--seq-length {self.seq_length} (+1 token); use more data, a larger --split share, or a "
                "shorter --seq-length"
            )
        num_epochs = 1
        if num_samples is not None:
            wanted = int(num_samples) * self.seq_length + 1
            num_epochs = max(1, -(-wanted // tokens_per_epoch))
        separate_final_epoch = False
        samples_before_final = 0
        if num_epochs > 1:
            samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // self.seq_length
            per_epoch = (tokens_per_epoch - 1) // self.seq_length
            separate_final_epoch = (int(num_samples) - samples_before_final) < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch
            )
        rng = np.random.RandomState(seed)
        self.document_index = build_document_index(self.documents, num_epochs, rng, separate_final_epoch)
        self.sample_index = build_sample_index(dataset.sequence_lengths, self.document_index, self.seq_length)
        total = self.sample_index.shape[0] - 1
        first = samples_before_final if separate_final_epoch else total
        self.shuffle_index = build_shuffle_index(first, total, rng)
        self.num_epochs = num_epochs

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (int64)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a dataset of {len(self)} samples")
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(v) for v in self.sample_index[i])
        doc_end, off_end = (int(v) for v in self.sample_index[i + 1])
        get = self.dataset.get
        if doc_beg == doc_end:
            pieces = [get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            pieces = [get(int(self.document_index[doc_beg]), off_beg)]
            pieces += [get(int(self.document_index[d])) for d in range(doc_beg + 1, doc_end)]
            pieces.append(get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return make_sample(self.sample_tokens(int(idx)), self.eod, self.eod_mask_loss)


def make_sample(text: np.ndarray, eod: int, eod_mask_loss: bool) -> dict[str, torch.Tensor]:
    """Turn ``seq_length + 1`` tokens into the model inputs, targets, loss mask and positions."""
    text = torch.from_numpy(np.ascontiguousarray(text, dtype=np.int64))
    tokens = text[:-1].contiguous()
    labels = text[1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(tokens.numel(), dtype=torch.int64)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}

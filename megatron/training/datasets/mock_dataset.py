"""Synthetic documents for ``--mock-data``: deterministic, needs no files, and learnable.

Like megatron-core's ``MockGPTLowLevelDataset``, this stands in for an ``IndexedDataset`` (same
``sequence_lengths`` / ``get``), so mock samples go through the very same ``GPTDataset`` split,
shuffle and sampler code as real data.

Document ``d`` is an arithmetic sequence modulo the body vocabulary ``V`` followed by ``eod``::

    start = a_d, stride = b_d:  a, a+b, a+2b, ... (mod V), eod

with ``a_d`` uniform in ``[0, V)``, ``b_d`` uniform in ``[1, MAX_STRIDE]`` and the length uniform in
``[max(2, seq_length // 2), 2 * seq_length]`` (eod included), all drawn up front from one
generator seeded with ``MOCK_CONTENT_SEED``. The corpus is fixed (the ``--seed`` only shuffles it, as for real
data). Inside a document the next token follows from the previous two, so a small GPT's loss falls
quickly from ``ln(V)``; the first token after an ``eod`` stays unpredictable.
"""

from __future__ import annotations

import numpy as np

MOCK_NUM_DOCUMENTS = 100_000  # megatron-core's mock corpus size
MOCK_CONTENT_SEED = 1234
MAX_STRIDE = 3


class MockLowLevelDataset:
    """``num_documents`` synthetic documents; token ids in ``[0, body_vocab_size)`` plus ``eod``."""

    def __init__(
        self,
        body_vocab_size: int,
        eod: int,
        seq_length: int,
        num_documents: int = MOCK_NUM_DOCUMENTS,
        content_seed: int = MOCK_CONTENT_SEED,
    ) -> None:
        if body_vocab_size < 1:
            raise ValueError(f"mock data needs a vocabulary of at least 1 id, got {body_vocab_size}")
        self.body_vocab_size = int(body_vocab_size)
        self.eod = int(eod)
        self.content_seed = int(content_seed)
        rng = np.random.default_rng([self.content_seed, 0])
        low, high = max(2, seq_length // 2), max(2, 2 * seq_length)
        self.sequence_lengths = rng.integers(low, high + 1, size=num_documents).astype(np.int32)
        self.starts = rng.integers(0, self.body_vocab_size, size=num_documents)
        self.strides = rng.integers(1, MAX_STRIDE + 1, size=num_documents)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def document(self, idx: int) -> np.ndarray:
        """The whole document ``idx``: its arithmetic body, then ``eod``."""
        length = int(self.sequence_lengths[idx])
        body = (int(self.starts[idx]) + int(self.strides[idx]) * np.arange(length - 1, dtype=np.int64))
        return np.append(body % self.body_vocab_size, self.eod).astype(np.int64)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``, like ``IndexedDataset.get``."""
        doc = self.document(int(idx))
        end = len(doc) if length is None else offset + length
        if offset < 0 or end > len(doc) or end < offset:
            raise IndexError(f"piece [{offset}, {end}) out of range for mock document {idx} of length {len(doc)}")
        return doc[offset:end]

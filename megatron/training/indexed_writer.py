"""The writer of Megatron's indexed dataset (``.bin``/``.idx`` pairs) for ``tools/preprocess_data.py``.

It writes, byte for byte, what megatron-core's ``IndexedDatasetBuilder`` writes and its
``IndexedDataset`` reads (tests/unit/frontend/test_indexed_writer.py checks both), but imports
in a tenth of a second: megatron-core's module takes several seconds to import (it pulls in
torch and megatron-core's package), which the preprocessing tool would pay on every start and
in every worker. Reading is megatron-core's alone (``data_loader.py``).

* ``PREFIX.bin``: every sequence's token ids, back to back, in one numpy dtype.
* ``PREFIX.idx``: the index, little-endian, laid out as megatron-core's ``_IndexWriter`` writes it::

      b"MMIDIDX\\x00\\x00"            9 bytes, magic
      version            uint64   always 1
      dtype code         uint8    see ``DTYPE_CODES``
      sequence count     uint64   S
      document count     uint64   D (= number of documents + 1: a leading 0 sentinel)
      sequence lengths   int32[S] tokens per sequence
      sequence pointers  int64[S] byte offset of each sequence in ``.bin``
      document indices   int64[D] sequence index where each document starts, then the end
"""

from __future__ import annotations

import struct

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

# megatron-core's DType enum values; the code is what lands in the .idx file.
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def optimal_dtype(vocab_size: int | None) -> type:
    """The token dtype megatron-core picks for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype).type
    if dtype not in DTYPE_CODES:
        valid = ", ".join(np.dtype(d).name for d in DTYPE_CODES)
        raise ValueError(f"indexed dataset dtype {np.dtype(dtype).name} is not supported; valid: {valid}")
    return DTYPE_CODES[dtype]


def write_index(
    idx_path: str, dtype, sequence_lengths: list[int] | np.ndarray, document_indices: list[int] | np.ndarray
) -> None:
    """Write a ``.idx`` file for sequences of the given lengths stored back to back in ``dtype``."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    doc_idx = np.asarray(document_indices, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", _dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(doc_idx.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Appends sequences to a ``.bin`` file and writes the matching ``.idx`` on ``finalize``.

    Same call pattern as megatron-core's ``IndexedDatasetBuilder``: ``add_item`` per sequence, ``end_document`` after
    each document's sequences (``add_document`` does both), ``finalize(idx_path)`` once.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        _dtype_code(dtype)
        self.dtype = np.dtype(dtype).type
        self.bin_path = bin_path
        self._bin = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence (any int iterable, numpy array or torch tensor)."""
        if hasattr(tokens, "detach"):
            tokens = tokens.detach().cpu().numpy()
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"add_item expects a 1-D sequence of token ids, got shape {array.shape}")
        if array.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            lo, hi = int(array.min()), int(array.max())
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"token id range [{lo}, {hi}] does not fit dataset dtype {np.dtype(self.dtype).name} "
                    f"[{info.min}, {info.max}]; build the dataset with a wider dtype"
                )
        self._bin.write(array.astype(self.dtype).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, sequences, lengths: list[int] | None = None) -> None:
        """Add one document: a list of sequences, or one flat array cut into ``lengths`` (Megatron's form)."""
        if lengths is None:
            for sequence in sequences:
                self.add_item(sequence)
        else:
            flat = np.asarray(sequences)
            if int(sum(lengths)) != flat.size:
                raise ValueError(f"add_document: lengths sum to {int(sum(lengths))} but {flat.size} tokens given")
            start = 0
            for length in lengths:
                self.add_item(flat[start : start + length])
                start += length
        self.end_document()

    def finalize(self, idx_path: str) -> None:
        """Flush the ``.bin`` and write the ``.idx``."""
        self._bin.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)

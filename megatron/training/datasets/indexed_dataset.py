"""Megatron's indexed dataset (``.bin``/``.idx`` pairs), byte-compatible with megatron-core.

A dataset is two files sharing a path prefix:

* ``PREFIX.bin``: every sequence's token ids, back to back, in one numpy dtype.
* ``PREFIX.idx``: the index, little-endian, laid out exactly as megatron-core's ``_IndexWriter`` writes it::

      b"MMIDIDX\\x00\\x00"            9 bytes, magic
      version            uint64   always 1
      dtype code         uint8    see ``DTYPE_CODES``
      sequence count     uint64   S
      document count     uint64   D (= number of documents + 1: a leading 0 sentinel)
      sequence lengths   int32[S] tokens per sequence
      sequence pointers  int64[S] byte offset of each sequence in ``.bin``
      document indices   int64[D] sequence index where each document starts, then the end

With document-level preprocessing (``tools/preprocess_data.py``) every document is one sequence.
Keeping the format byte for byte lets users point ``--data-path`` at datasets they already built
with Megatron-LM, and lets Megatron-LM read ours.
"""

from __future__ import annotations

import os
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
CODE_TO_DTYPE: dict[int, type] = {code: dtype for dtype, code in DTYPE_CODES.items()}


def data_file_path(path_prefix: str) -> str:
    """The ``.bin`` path of a dataset prefix."""
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    """The ``.idx`` path of a dataset prefix."""
    return path_prefix + ".idx"


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


def check_dataset_files(path_prefix: str, flag: str = "--data-path") -> None:
    """Raise FileNotFoundError naming the missing ``.bin`` or ``.idx`` file of a prefix."""
    for path in (data_file_path(path_prefix), index_file_path(path_prefix)):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{flag} {path_prefix}: missing {path} (an indexed dataset is a PREFIX.bin/PREFIX.idx pair, "
                f"written by tools/preprocess_data.py or Megatron-LM's preprocess_data.py)"
            )


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

    Same call pattern as megatron-core's builder: ``add_item`` per sequence, ``end_document`` after
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

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype), as megatron-core's ``add_index`` merges shards."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"add_index: {path_prefix} has dtype {np.dtype(other.dtype).name}, "
                f"builder has {np.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(i) + offset for i in other.document_indices[1:])
        with open(data_file_path(path_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self, idx_path: str) -> None:
        """Flush the ``.bin`` and write the ``.idx``."""
        self._bin.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)


def _truncated(path: str, size: int, needed: int, what: str) -> str:
    return (f"{path} is truncated or corrupt: it holds {size} bytes, {needed} are needed for {what}; copy or "
            "preprocess the dataset again (tools/preprocess_data.py)")


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair through numpy memmaps (nothing is loaded up front).

    ``ds[i]`` is sequence ``i`` as a numpy array; ``ds.get(i, offset, length)`` reads a piece of it.
    """

    def __init__(self, path_prefix: str) -> None:
        check_dataset_files(path_prefix)
        self.path_prefix = path_prefix
        idx_path = index_file_path(path_prefix)
        idx_size = os.path.getsize(idx_path)
        header_size = len(INDEX_HEADER) + 8 + 1 + 8 + 8
        with open(idx_path, "rb") as f:
            header = f.read(len(INDEX_HEADER))
            if header != INDEX_HEADER:
                raise ValueError(f"{idx_path} is not a Megatron indexed dataset index (bad magic {header!r})")
            if idx_size < header_size:
                raise ValueError(_truncated(idx_path, idx_size, header_size, "its header"))
            (version,) = struct.unpack("<Q", f.read(8))
            if version != INDEX_VERSION:
                raise ValueError(f"{idx_path}: unsupported index version {version} (expected {INDEX_VERSION})")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in CODE_TO_DTYPE:
                raise ValueError(f"{idx_path}: unknown dtype code {code}")
            self.dtype = CODE_TO_DTYPE[code]
            (sequence_count,) = struct.unpack("<Q", f.read(8))
            (document_count,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        expected = offset + sequence_count * (4 + 8) + document_count * 8
        if idx_size < expected:
            raise ValueError(_truncated(idx_path, idx_size, expected,
                                        f"{sequence_count} sequences and {document_count} document indices"))
        index = np.memmap(idx_path, mode="r", order="C")
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype="<i8", count=document_count, offset=offset)
        bin_path = data_file_path(path_prefix)
        self._check_bin_size(bin_path, os.path.getsize(bin_path))
        if os.path.getsize(bin_path) == 0:
            self._bin = np.zeros(0, dtype=np.uint8)  # np.memmap rejects empty files
        else:
            self._bin = np.memmap(bin_path, mode="r", order="C")

    def _check_bin_size(self, bin_path: str, bin_size: int) -> None:
        """Raise, naming the file, if the index points past the end of ``.bin`` (a truncated copy or write).

        Vectorised over the index (no token is read), so it costs milliseconds even for millions of
        sequences; without it a cut file fails only when training reaches the cut document.
        """
        if not len(self.sequence_lengths):
            return
        if (self.sequence_lengths < 0).any() or (self.sequence_pointers < 0).any():
            raise ValueError(f"{index_file_path(self.path_prefix)} is corrupt: negative sequence lengths or pointers")
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * np.dtype(self.dtype).itemsize
        last = int(np.argmax(ends))
        if int(ends[last]) > bin_size:
            raise ValueError(_truncated(bin_path, bin_size, int(ends[last]), f"sequence {last} (per its .idx)"))

    def __getstate__(self) -> dict:
        # pickle by path: DataLoader workers started by spawn/forkserver re-map the files
        # instead of receiving copies of them
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def __getitem__(self, idx: int | slice):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"piece [{offset}, {offset + length}) out of range for sequence {idx} of length {size}")
        itemsize = np.dtype(self.dtype).itemsize
        start = int(self.sequence_pointers[idx]) + offset * itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def num_documents(self) -> int:
        """Number of documents (the index stores one more entry: the leading 0)."""
        return max(int(self.document_indices.shape[0]) - 1, 0)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both files of the prefix exist."""
        return os.path.isfile(data_file_path(path_prefix)) and os.path.isfile(index_file_path(path_prefix))

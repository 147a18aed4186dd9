"""The preprocessing tool's light writer (megatron/training/indexed_writer.py): megatron-core's byte layout,
read back by megatron-core's ``IndexedDataset``, the same bytes as megatron-core's own writer, and its errors."""

import struct

import numpy as np
import pytest
import torch
from megatron.core.datasets import indexed_dataset as mcore

from megatron.training.indexed_writer import IndexedDatasetBuilder, optimal_dtype


def build(prefix, documents, dtype=np.uint16):
    """documents: list of documents, each a list of sequences."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_index_bytes_match_megatron_layout(tmp_path):
    # two documents: [5, 6, 7] and [8, 9]+[10] (two sequences), stored as int32
    prefix = build(tmp_path / "d", [[[5, 6, 7]], [[8, 9], [10]]], np.int32)
    expected = (
        b"MMIDIDX\x00\x00"
        + (1).to_bytes(8, "little")  # version
        + bytes([4])  # dtype code of int32 in megatron-core's DType enum
        + (3).to_bytes(8, "little")  # sequences
        + (3).to_bytes(8, "little")  # document indices: 0, 1, 3
        + b"".join(n.to_bytes(4, "little") for n in (3, 2, 1))  # lengths int32
        + b"".join(n.to_bytes(8, "little") for n in (0, 12, 20))  # byte pointers int64
        + b"".join(n.to_bytes(8, "little") for n in (0, 1, 3))  # document indices int64
    )
    assert open(prefix + ".idx", "rb").read() == expected
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6i", 5, 6, 7, 8, 9, 10)


@pytest.mark.parametrize(
    "dtype,code", [(np.uint8, 1), (np.int8, 2), (np.int16, 3), (np.int32, 4), (np.int64, 5), (np.uint16, 8)]
)
def test_dtype_codes_read_by_megatron_core(tmp_path, dtype, code):
    prefix = build(tmp_path / "d", [[[1, 2]]], dtype)
    assert open(prefix + ".idx", "rb").read()[17] == code
    ds = mcore.IndexedDataset(prefix)
    assert ds.index.dtype == dtype
    assert ds[0].tolist() == [1, 2]


def test_megatron_core_reads_what_it_wrote(tmp_path):
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 50000, size=int(rng.integers(0, 40))).tolist() for _ in range(int(rng.integers(1, 4)))]
        for _ in range(30)
    ]
    prefix = build(tmp_path / "r", documents)
    ds = mcore.IndexedDataset(prefix)
    flat = [seq for doc in documents for seq in doc]
    assert len(ds) == len(flat)
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    assert ds.document_indices.tolist() == [0] + np.cumsum([len(d) for d in documents]).tolist()
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq
        if len(seq) >= 3:
            assert ds.get(i, 1, len(seq) - 2).tolist() == seq[1:-1]


def test_add_document_flat_and_torch_input(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "t.bin"), np.int32)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), lengths=[2, 3])
    builder.add_document([torch.tensor([7]), np.array([8, 9])])
    builder.finalize(str(tmp_path / "t.idx"))
    ds = mcore.IndexedDataset(str(tmp_path / "t"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 4, 5], [7], [8, 9]]
    assert ds.document_indices.tolist() == [0, 2, 4]


def test_optimal_dtype_matches_megatron():
    for vocab in (257, 65499, 65500, None):
        assert optimal_dtype(vocab) == mcore.DType.optimal_dtype(vocab)


def test_errors(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        builder.add_item([70000])
    with pytest.raises(ValueError, match="not supported"):
        IndexedDatasetBuilder(str(tmp_path / "f.bin"), np.float16)


def test_bytes_equal_megatron_core_writer(tmp_path):
    """megatron-core's builder writes the same bytes as the light writer."""
    rng = np.random.default_rng(1)
    documents = [[rng.integers(0, 60000, size=int(rng.integers(1, 30))).tolist()] for _ in range(50)]
    build(tmp_path / "ours", documents)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.tensor(document[0]))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()

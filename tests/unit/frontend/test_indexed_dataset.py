"""Megatron's .bin/.idx format: byte layout of the index, writer/reader round trip, errors."""

import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.training.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    optimal_dtype,
)


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
def test_dtype_codes(tmp_path, dtype, code):
    prefix = build(tmp_path / "d", [[[1, 2]]], dtype)
    assert open(prefix + ".idx", "rb").read()[17] == code
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    assert ds[0].tolist() == [1, 2]


def test_round_trip_random(tmp_path):
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 50000, size=int(rng.integers(0, 40))).tolist() for _ in range(int(rng.integers(1, 4)))]
        for _ in range(30)
    ]
    prefix = build(tmp_path / "r", documents)
    ds = IndexedDataset(prefix)
    flat = [seq for doc in documents for seq in doc]
    assert len(ds) == len(flat)
    assert ds.num_documents == len(documents)
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    assert ds.document_indices.tolist() == [0] + np.cumsum([len(d) for d in documents]).tolist()
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq
        if len(seq) >= 3:
            assert ds.get(i, 1, len(seq) - 2).tolist() == seq[1:-1]
            assert ds.get(i, 2).tolist() == seq[2:]
    assert [a.tolist() for a in ds[2:5]] == flat[2:5]
    assert ds[-1].tolist() == flat[-1]
    blob = pickle.dumps(ds)
    assert len(blob) < 1000, "pickled by path, not by content"
    assert pickle.loads(blob)[3].tolist() == flat[3]


def test_add_document_flat_and_torch_input(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "t.bin"), np.int32)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), lengths=[2, 3])
    builder.add_document([torch.tensor([7]), np.array([8, 9])])
    builder.finalize(str(tmp_path / "t.idx"))
    ds = IndexedDataset(str(tmp_path / "t"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 4, 5], [7], [8, 9]]
    assert ds.document_indices.tolist() == [0, 2, 4]


def test_add_index_merges_datasets(tmp_path):
    a = build(tmp_path / "a", [[[1, 2]], [[3]]])
    b = build(tmp_path / "b", [[[4, 5, 6]]])
    merged = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5, 6]]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]


def test_empty_dataset(tmp_path):
    prefix = build(tmp_path / "e", [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_optimal_dtype_matches_megatron():
    assert optimal_dtype(257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_errors(tmp_path):
    prefix = build(tmp_path / "x", [[[1, 2, 3]]])
    (tmp_path / "only.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only.idx"):
        IndexedDataset(str(tmp_path / "only"))
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        IndexedDataset(str(tmp_path / "nothing"))
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"NOTMMID" + bytes(40))
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(str(tmp_path / "bad"))
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)
    with pytest.raises(IndexError):
        ds[1]
    builder = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        builder.add_item([70000])
    with pytest.raises(ValueError, match="not supported"):
        IndexedDatasetBuilder(str(tmp_path / "f.bin"), np.float16)


@pytest.mark.parametrize("suffix, keep, message", [
    (".bin", -1, r"t\.bin is truncated or corrupt: it holds 15 bytes, 16 are needed for sequence 2"),
    (".bin", 0, r"t\.bin is truncated or corrupt: it holds 0 bytes, 16 are needed"),
    (".idx", -8, r"t\.idx is truncated or corrupt: .* 3 sequences and 4 document indices"),
    (".idx", 20, r"t\.idx is truncated or corrupt: it holds 20 bytes, 34 are needed for its header"),
])
def test_truncated_files_fail_at_open_naming_the_file(tmp_path, suffix, keep, message):
    """A cut .bin/.idx is found when the dataset is opened (at start-up), not when the cut document is read."""
    prefix = build(tmp_path / "t", [[[1, 2, 3]], [[4, 5, 6, 7]], [[8]]])
    path = tmp_path / f"t{suffix}"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep else b"")
    with pytest.raises(ValueError, match=message):
        IndexedDataset(prefix)


def test_bytes_equal_megatron_core_writer(tmp_path):
    """Where megatron-core is installed, its builder writes the same bytes and its reader reads ours."""
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(1)
    documents = [[rng.integers(0, 60000, size=int(rng.integers(1, 30))).tolist()] for _ in range(50)]
    ours = build(tmp_path / "ours", documents)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.tensor(document[0]))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()
    theirs = mcore.IndexedDataset(ours)
    assert [theirs[i].tolist() for i in range(len(theirs))] == [d[0] for d in documents]

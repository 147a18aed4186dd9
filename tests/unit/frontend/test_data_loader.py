"""The data path of pretrain_gpt.py: megatron-core's datasets as Megatron-LM builds them, Megatron's sampler
(layout, dp-size independence, resume), the front-end's checks before megatron-core's builder, the mock corpus."""

import argparse

import numpy as np
import pytest
import torch

from megatron.training.data_loader import (
    MegatronPretrainingSampler,
    MockCorpus,
    build_train_valid_test_data_iterators,
    build_train_valid_test_datasets,
    check_dataset_files,
    data_prefixes,
)
from megatron.training.errors import UsageValueError
from megatron.training.indexed_writer import IndexedDatasetBuilder
from megatron.training.tokenizer import build_tokenizer

MBS, GBS, SEQ = 2, 8, 12


def make_args(**overrides):
    args = dict(
        mock_data=True, data_path=None, split="969,30,1", seq_length=SEQ, micro_batch_size=MBS,
        global_batch_size=GBS, train_iters=6, eval_iters=2, eval_interval=3, seed=1234, vocab_size=50,
        tokenizer_type="NullTokenizer", tokenizer_model=None, eod_mask_loss=False, num_workers=0,
        data_cache_path=None,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def sample_rows(dataset, indices):
    return torch.stack([dataset[i]["tokens"] for i in indices])


def steps_by_rank(args, dp_size, split=0, consumed_train_samples=0):
    """micro-batches[rank] (list of dicts) from fresh iterators of every rank."""
    iterators = [
        build_train_valid_test_data_iterators(args, r, dp_size, consumed_train_samples=consumed_train_samples)
        for r in range(dp_size)
    ]
    return [list(its[split]) for its in iterators]


def test_sampler_indices():
    sampler = MegatronPretrainingSampler(20, 0, 2, dp_rank=1, dp_size=3)
    assert list(sampler) == [[2, 3], [8, 9], [14, 15]]
    assert len(sampler) == 3
    assert list(MegatronPretrainingSampler(20, 12, 2, 0, 3)) == [[12, 13]]
    assert list(MegatronPretrainingSampler(4, 4, 2, 0, 1)) == []


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_micro_batch_layout_and_union(dp_size):
    args = make_args()
    train, _, _ = build_train_valid_test_datasets(args, build_tokenizer(args))
    per_rank = steps_by_rank(args, dp_size)
    micro_per_step = GBS // (MBS * dp_size)
    assert all(len(batches) == args.train_iters * micro_per_step for batches in per_rank)
    for step in range(args.train_iters):
        seen = []
        for rank in range(dp_size):
            for m in range(micro_per_step):
                batch = per_rank[rank][step * micro_per_step + m]
                assert batch["tokens"].shape == (MBS, SEQ) and batch["loss_mask"].shape == (MBS, SEQ)
                first = step * GBS + m * MBS * dp_size + rank * MBS
                assert torch.equal(batch["tokens"], sample_rows(train, range(first, first + MBS)))
                assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
                seen += [tuple(row.tolist()) for row in batch["tokens"]]
        expected = [tuple(row.tolist()) for row in sample_rows(train, range(step * GBS, (step + 1) * GBS))]
        assert sorted(seen) == sorted(expected)


def test_resume_at_same_and_different_dp_size():
    args = make_args()
    full = steps_by_rank(args, 2)
    resumed = steps_by_rank(make_args(), 2, consumed_train_samples=3 * GBS)
    for rank in range(2):
        tail = full[rank][3 * 2 :]  # 2 micro-batches per step per rank at dp 2
        assert len(resumed[rank]) == len(tail)
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(tail, resumed[rank]))
    # resume at dp 4: each step still holds the same set of samples
    resumed4 = steps_by_rank(make_args(), 4, consumed_train_samples=3 * GBS)
    for step in range(3):
        ref = torch.cat([full[r][(3 + step) * 2 + m]["tokens"] for r in range(2) for m in range(2)])
        got = torch.cat([resumed4[r][step]["tokens"] for r in range(4)])
        assert sorted(map(tuple, ref.tolist())) == sorted(map(tuple, got.tolist()))


def test_valid_and_test_sample_counts():
    args = make_args()
    _, valid, test = build_train_valid_test_data_iterators(args, 0, 2)
    per_micro = MBS * 2
    assert len(list(valid)) == (6 // 3 + 1) * 2 * GBS // per_micro
    assert len(list(test)) == 2 * GBS // per_micro
    _, valid, test = build_train_valid_test_data_iterators(make_args(eval_iters=0), 0, 1)
    assert valid is None and test is None
    _, valid_resumed, _ = build_train_valid_test_data_iterators(make_args(), 0, 1, consumed_valid_samples=GBS)
    _, valid_full, _ = build_train_valid_test_data_iterators(args, 0, 1)
    full = list(valid_full)
    rest = list(valid_resumed)
    assert len(rest) == len(full) - GBS // MBS
    assert torch.equal(rest[0]["tokens"], full[GBS // MBS]["tokens"])


def test_workers_give_the_same_batches():
    a = list(build_train_valid_test_data_iterators(make_args(train_iters=2), 1, 2)[0])
    b = list(build_train_valid_test_data_iterators(make_args(train_iters=2, num_workers=1), 1, 2)[0])
    assert len(a) == len(b) == 4
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_indexed_data_path(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        builder.add_item(rng.integers(0, 50, size=int(rng.integers(3, 30))).tolist() + [50])
        builder.end_document()
    builder.finalize(str(tmp_path / "c.idx"))
    args = make_args(mock_data=False, data_path=[str(tmp_path / "c")], split="90,5,5", eod_mask_loss=True)
    train, valid, test = build_train_valid_test_data_iterators(args, 0, 1)
    batches = list(train)
    assert len(batches) == args.train_iters * GBS // MBS
    for batch in batches:
        assert torch.equal(batch["loss_mask"] == 0, batch["tokens"] == 50)
        assert batch["position_ids"].tolist() == [list(range(SEQ))] * MBS
    assert valid is not None and test is not None


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--global-batch-size \(6\).*--micro-batch-size \(2\).*\(2\)"):
        build_train_valid_test_data_iterators(make_args(global_batch_size=6), 0, 2)
    with pytest.raises(ValueError, match="--data-path.*--mock-data"):
        build_train_valid_test_data_iterators(make_args(mock_data=False), 0, 1)
    with pytest.raises(FileNotFoundError, match="missing.*gone.bin"):
        build_train_valid_test_data_iterators(make_args(mock_data=False, data_path=[str(tmp_path / "gone")]), 0, 1)
    with pytest.raises(ValueError, match="--split"):
        build_train_valid_test_data_iterators(make_args(split="train,valid"), 0, 1)
    with pytest.raises(ValueError, match="consumed samples 3"):
        build_train_valid_test_data_iterators(make_args(), 0, 1, consumed_train_samples=3)
    with pytest.raises(ValueError, match="consumed samples"):
        build_train_valid_test_data_iterators(make_args(), 0, 1, consumed_train_samples=100 * GBS)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_train_valid_test_data_iterators(make_args(vocab_size=None), 0, 1)
    with pytest.raises(ValueError, match="data-parallel rank 2"):
        build_train_valid_test_data_iterators(make_args(), 2, 2)


def test_token_ids_beyond_the_tokenizer_are_named(tmp_path):
    """Data tokenized with a larger vocabulary than --vocab-size: a clear error, not IndexError in the embedding."""
    builder = IndexedDatasetBuilder(str(tmp_path / "big.bin"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(100):
        builder.add_item(rng.integers(0, 100, size=20).tolist() + [100])  # ids of a 100-token vocabulary
        builder.end_document()
    builder.finalize(str(tmp_path / "big.idx"))
    prefix = str(tmp_path / "big")
    train, _, _ = build_train_valid_test_data_iterators(make_args(mock_data=False, data_path=[prefix]), 0, 1)
    with pytest.raises(ValueError) as info:
        next(train)
    message = str(info.value)
    assert f"--data-path {prefix} (train split): token id" in message
    assert "outside the tokenizer's vocabulary [0, 51)" in message and "--vocab-size" in message
    # the vocabulary the data was built with passes
    train, _, _ = build_train_valid_test_data_iterators(
        make_args(mock_data=False, data_path=[prefix], vocab_size=100), 0, 1)
    assert next(train)["tokens"].max() <= 100


def write_docs(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_a_split_without_documents_stops_before_megatron_cores_builder(tmp_path):
    """50 documents with --split 969,30,1 leave the test split none: megatron-core's builder would add empty
    epochs forever; the front-end drops that split (single dataset) or names --split (train, or a blend member)."""
    rng = np.random.default_rng(0)
    a = write_docs(tmp_path / "a", [rng.integers(0, 50, size=8).tolist() + [50] for _ in range(50)])
    b = write_docs(tmp_path / "b", [rng.integers(0, 50, size=8).tolist() + [50] for _ in range(500)])
    train, valid, test = build_train_valid_test_data_iterators(make_args(mock_data=False, data_path=[a]), 0, 1)
    assert train is not None and valid is not None and test is None
    assert len(list(train)) == 6 * GBS // MBS
    with pytest.raises(UsageValueError, match=r"--split 969,30,1 leaves the test split of --data-path .*a without "
                                              r"tokens \(documents \[50, 50\) of 50\)"):
        build_train_valid_test_data_iterators(make_args(mock_data=False, data_path=["1", a, "1", b]), 0, 1)
    with pytest.raises(UsageValueError, match="--split 1,999,0 leaves the train split of --data-path .* without "
                                              "documents"):
        build_train_valid_test_data_iterators(make_args(mock_data=False, data_path=[a], split="1,999,0"), 0, 1)


def test_data_path_checks_name_the_file(tmp_path):
    prefix = write_docs(tmp_path / "t", [[1, 2, 3], [4, 5, 6, 7], [8]])
    assert len(check_dataset_files(prefix)) == 3  # megatron-core's IndexedDataset
    with pytest.raises(FileNotFoundError, match=r"--data-path .*nope: missing .*nope\.bin"):
        check_dataset_files(str(tmp_path / "nope"))
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"t\.bin is truncated or corrupt: it holds 15 bytes, 16 are needed for "
                                         r"sequence 2"):
        check_dataset_files(prefix)
    (tmp_path / "t.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"t\.bin is truncated or corrupt: it holds 0 bytes, 16 are needed"):
        check_dataset_files(prefix)
    (tmp_path / "t.bin").write_bytes(data)
    index = (tmp_path / "t.idx").read_bytes()
    for cut in (index[:-8], index[:20], b"NOTMMID" + bytes(40)):
        (tmp_path / "t.idx").write_bytes(cut)
        with pytest.raises(ValueError, match=r"t\.idx is truncated or corrupt: megatron-core's IndexedDataset cannot"):
            check_dataset_files(prefix)
    with pytest.raises(UsageValueError, match="mixes numbers and prefixes"):
        data_prefixes(make_args(mock_data=False, data_path=["0.3", "a", "b"]))
    assert data_prefixes(make_args(mock_data=False, data_path=["0.3", "a", "0.9", "b"])) == ["a", "b"]


def test_mock_documents_are_deterministic_progressions():
    a, b = MockCorpus(97, 97, seq_length=16, num_documents=200), MockCorpus(97, 97, seq_length=16, num_documents=200)
    assert a.sequence_lengths.dtype == np.int32  # what megatron-core's GPTDataset requires
    for d in range(200):
        doc = a.get(d)
        assert doc.tolist() == b.get(d).tolist()
        assert 8 <= len(doc) <= 32 and doc[-1] == 97 and len(doc) == a.sequence_lengths[d]
        body = doc[:-1]
        assert body.min() >= 0 and body.max() < 97
        if len(body) >= 2:
            steps = np.unique((body[1:] - body[:-1]) % 97)
            assert len(steps) == 1 and 1 <= steps[0] <= 3
        assert a.get(d, 1, 3).tolist() == doc[1:4].tolist()


def test_mock_data_honours_split_and_seed():
    """--mock-data goes through megatron-core's MockGPTDataset with this project's corpus and --split."""
    args = make_args(vocab_size=64, seq_length=16)
    tok = build_tokenizer(args)
    train, valid, test = build_train_valid_test_datasets(args, tok)
    assert type(train).__mro__[1].__name__ == "MockGPTDataset"
    assert (train.indices.min(), train.indices.max()) == (0, 96899)  # 969/1000 of 100,000 documents
    assert (valid.indices.min(), valid.indices.max()) == (96900, 99899) and test.indices.min() == 99900
    again, _, _ = build_train_valid_test_datasets(args, tok)
    other, _, _ = build_train_valid_test_datasets(make_args(vocab_size=64, seq_length=16, seed=5), tok)
    for i in range(10):
        s = train[i]
        assert int(s["tokens"].max()) <= 64 and int(s["tokens"].min()) >= 0
        assert torch.equal(s["tokens"], again[i]["tokens"])
    assert any(not torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(10))

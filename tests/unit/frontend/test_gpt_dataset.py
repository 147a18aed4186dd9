"""GPT samples: shift, document crossing, index construction vs a reference, split, blend, mock data."""

import argparse

import numpy as np
import pytest
import torch

from megatron.training.datasets.blended_dataset import build_blending_indices
from megatron.training.datasets.builder import (
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_document_ranges,
)
from megatron.training.datasets.gpt_dataset import GPTDataset, build_sample_index
from megatron.training.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.datasets.mock_dataset import MockLowLevelDataset
from megatron.training.tokenizer import build_tokenizer

EOD = 1000


def write_docs(prefix, documents):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return IndexedDataset(str(prefix))


def marked_docs(n, rng, base=0):
    """Document d holds tokens base + d (so every token names its document), then EOD."""
    return [[base + d] * int(rng.integers(1, 12)) + [EOD] for d in range(n)]


def reference_sample_index(sizes, doc_idx, seq_length):
    """megatron-core's build_sample_idx loop (add_extra_token = 1), ported literally."""
    num_samples = (int(sum(sizes[d] for d in doc_idx)) - 1) // seq_length
    out = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out.append((doc_idx_index, doc_offset))
    return np.array(out)


def test_sample_index_matches_megatron_loop():
    rng = np.random.default_rng(3)
    for seq_length in (1, 3, 8, 50):
        sizes = rng.integers(0, 20, size=40)  # includes empty documents
        sizes[0] = 5
        doc_idx = rng.permutation(np.tile(np.arange(40), 2))
        ours = build_sample_index(sizes, doc_idx, seq_length)
        np.testing.assert_array_equal(ours, reference_sample_index(sizes, doc_idx, seq_length))


def test_samples_are_stream_slices(tmp_path):
    rng = np.random.default_rng(0)
    docs = marked_docs(25, rng)
    ds = GPTDataset(write_docs(tmp_path / "d", docs), np.arange(25), 60, seq_length=8, seed=5, eod=EOD)
    assert len(ds) >= 60 and ds.num_epochs > 1
    stream = np.concatenate([docs[d] for d in ds.document_index])
    crossed = 0
    for j in range(len(ds)):
        i = int(ds.shuffle_index[j])
        expected = stream[i * 8 : i * 8 + 9]
        sample = ds[j]
        assert sample["tokens"].tolist() == expected[:-1].tolist()
        assert sample["labels"].tolist() == expected[1:].tolist()
        assert sample["tokens"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.float32
        assert sample["position_ids"].tolist() == list(range(8))
        assert torch.all(sample["loss_mask"] == 1)
        crossed += int((sample["tokens"] == EOD).any())
    assert crossed > 0, "samples should cross document boundaries"


def test_epochs_and_separate_final_epoch(tmp_path):
    rng = np.random.default_rng(1)
    docs = marked_docs(30, rng)
    low = write_docs(tmp_path / "d", docs)
    per_epoch = (sum(len(d) for d in docs) - 1) // 4
    # a little over one epoch: the final epoch is shuffled on its own
    ds = GPTDataset(low, np.arange(30), per_epoch + 2, seq_length=4, seed=7, eod=EOD)
    assert ds.num_epochs == 2
    assert sorted(ds.document_index[:30].tolist()) == list(range(30))
    assert sorted(ds.document_index[30:].tolist()) == list(range(30))
    before = ((sum(len(d) for d in docs)) - 1) // 4
    assert sorted(ds.shuffle_index[:before].tolist()) == list(range(before))
    # most of a second epoch: both epochs shuffled together (still each document twice)
    ds = GPTDataset(low, np.arange(30), 2 * per_epoch - 1, seq_length=4, seed=7, eod=EOD)
    assert ds.num_epochs == 2
    assert np.bincount(ds.document_index, minlength=30).tolist() == [2] * 30
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))


def test_determinism_and_seed(tmp_path):
    low = write_docs(tmp_path / "d", marked_docs(40, np.random.default_rng(2)))
    a = GPTDataset(low, np.arange(40), 30, 6, seed=11, eod=EOD)
    b = GPTDataset(low, np.arange(40), 30, 6, seed=11, eod=EOD)
    c = GPTDataset(low, np.arange(40), 30, 6, seed=12, eod=EOD)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(min(len(a), len(c))))


def test_eod_mask_loss(tmp_path):
    low = write_docs(tmp_path / "d", marked_docs(20, np.random.default_rng(4)))
    ds = GPTDataset(low, np.arange(20), 10, 16, seed=1, eod=EOD, eod_mask_loss=True)
    for i in range(len(ds)):
        s = ds[i]
        assert torch.equal(s["loss_mask"] == 0, s["tokens"] == EOD)


def test_too_little_data_is_an_error(tmp_path):
    low = write_docs(tmp_path / "d", [[1, 2, EOD]])
    with pytest.raises(ValueError, match="too few"):
        GPTDataset(low, np.arange(1), 4, 8, seed=1, eod=EOD)


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("1/1") == pytest.approx([0.5, 0.5, 0.0])
    assert parse_split("100") == pytest.approx([1.0, 0.0, 0.0])
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2", "", "1,,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split_document_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(parse_split("98,2,0"), 10) == [(0, 10), (10, 10), (10, 10)]


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    prefixes, weights = parse_data_path(["0.3", "a", "0.9", "b"])
    assert prefixes == ["a", "b"] and weights == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="--data-path"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="--data-path"):
        parse_data_path([])


def test_blending_indices_follow_weights():
    weights = [0.5, 0.3, 0.2]
    dataset_index, sample_index = build_blending_indices(weights, 1000)
    for n in (10, 100, 1000):
        counts = np.bincount(dataset_index[:n], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0)
    for d in range(3):
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


def make_args(**overrides):
    args = dict(
        mock_data=False, data_path=None, split="8,1,1", seq_length=8, micro_batch_size=2, global_batch_size=4,
        train_iters=10, eval_iters=2, eval_interval=5, seed=1234, vocab_size=EOD, tokenizer_type="NullTokenizer",
        tokenizer_model=None, eod_mask_loss=False, num_workers=0,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def test_split_keeps_documents_apart(tmp_path):
    write_docs(tmp_path / "d", marked_docs(100, np.random.default_rng(5)))
    args = make_args(data_path=[str(tmp_path / "d")])
    train, valid, test = build_train_valid_test_datasets(args, build_tokenizer(args))
    assert len(train) >= 40 and len(valid) >= 3 * 2 * 4 and len(test) >= 8
    for ds, (lo, hi) in ((train, (0, 80)), (valid, (80, 90)), (test, (90, 100))):
        tokens = torch.cat([ds[i]["tokens"] for i in range(len(ds))])
        body = tokens[tokens != EOD]
        assert int(body.min()) >= lo and int(body.max()) < hi


def test_weighted_blend_from_data_path(tmp_path):
    rng = np.random.default_rng(6)
    write_docs(tmp_path / "a", marked_docs(50, rng, base=0))
    write_docs(tmp_path / "b", marked_docs(50, rng, base=500))
    args = make_args(data_path=["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")], split="1", eval_iters=0)
    train, valid, test = build_train_valid_test_datasets(args, build_tokenizer(args))
    assert valid is None and test is None and len(train) == 40
    from_b = [int(train.dataset_index[i]) for i in range(len(train))]
    assert sum(from_b) == 30
    for i in range(len(train)):
        body = train[i]["tokens"][train[i]["tokens"] != EOD]
        assert bool(((body >= 500) == bool(from_b[i])).all())
    again, _, _ = build_train_valid_test_datasets(args, build_tokenizer(args))
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(len(train)))


def test_missing_prefix_names_the_file(tmp_path):
    args = make_args(data_path=[str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        build_train_valid_test_datasets(args, build_tokenizer(args))


def test_mock_documents_are_deterministic_progressions():
    a = MockLowLevelDataset(97, 97, seq_length=16, num_documents=200)
    b = MockLowLevelDataset(97, 97, seq_length=16, num_documents=200)
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


def test_mock_data_splits_and_seed():
    args = make_args(mock_data=True, vocab_size=64, seq_length=16, split="969,30,1")
    tok = build_tokenizer(args)
    train, valid, test = build_train_valid_test_datasets(args, tok)
    again, _, _ = build_train_valid_test_datasets(args, tok)
    other, _, _ = build_train_valid_test_datasets(make_args(mock_data=True, vocab_size=64, seq_length=16, seed=5), tok)
    assert len(train) >= 40 and valid is not None and test is not None
    for i in range(10):
        s = train[i]
        assert int(s["tokens"].max()) <= 64 and int(s["tokens"].min()) >= 0
        assert torch.equal(s["tokens"], again[i]["tokens"])
    assert any(not torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(10))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, seq, dim=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, tokens, position_ids):
        h = self.embed(tokens) + self.pos(position_ids)
        return self.head(self.block(h, src_mask=self.causal))


def test_mock_data_is_learnable():
    """A one-layer GPT's loss on mock data falls well below ln(vocab) within 30 steps."""
    from megatron.training.data_loader import build_train_valid_test_data_iterators

    torch.manual_seed(0)
    args = make_args(mock_data=True, vocab_size=64, seq_length=32, micro_batch_size=16, global_batch_size=16,
                     train_iters=30, eval_iters=0)
    train_iter, _, _ = build_train_valid_test_data_iterators(args, 0, 1)
    model = TinyGPT(65, 32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for batch in train_iter:
        logits = model(batch["tokens"], batch["position_ids"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 65), batch["labels"].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 30
    assert losses[0] > 0.9 * np.log(65)
    assert np.mean(losses[-5:]) < 0.6 * losses[0], losses


class _McoreTokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    vocab_size = EOD + 1
    eod = EOD
    pad = -1

    @property
    def unique_identifiers(self):
        return {"class": "test-tokenizer"}


@pytest.mark.parametrize(
    "weighted,split,seq,gbs,iters,eval_iters,eval_interval,seed,eod_mask",
    [
        (False, "90,8,2", 16, 4, 50, 2, 10, 1234, False),
        (False, "80,15,5", 7, 8, 300, 3, 50, 7, True),  # many epochs, separate final epoch
        (False, "80,15,5", 16, 8, 34, 1, 50, 7, False),
        (True, "90,8,2", 16, 4, 40, 2, 10, 99, False),  # weighted blend
    ],
)
def test_samples_equal_megatron_core(tmp_path, weighted, split, seq, gbs, iters, eval_iters, eval_interval, seed,
                                     eod_mask):
    """Where megatron-core is installed, its GPTDataset/BlendedDataset give the very same samples."""
    mcore_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    rng = np.random.default_rng(0)
    write_docs(tmp_path / "a", [rng.integers(0, EOD, size=int(rng.integers(1, 40))).tolist() + [EOD]
                                for _ in range(300)])
    write_docs(tmp_path / "b", [rng.integers(0, EOD, size=int(rng.integers(1, 20))).tolist() + [EOD]
                                for _ in range(120)])
    data_path = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")] if weighted else [str(tmp_path / "a")]
    args = make_args(data_path=data_path, split=split, seq_length=seq, micro_batch_size=1, global_batch_size=gbs,
                     train_iters=iters, eval_iters=eval_iters, eval_interval=eval_interval, seed=seed,
                     eod_mask_loss=eod_mask)
    ours = build_train_valid_test_datasets(args, build_tokenizer(args))
    sizes = [iters * gbs, (iters // eval_interval + 1) * eval_iters * gbs, eval_iters * gbs]
    config = mcore_gpt.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=get_blend_from_list(data_path), split=split,
        tokenizer=_McoreTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=eod_mask, create_attention_mask=False, path_to_cache=None, mmap_bin_files=True,
    )
    theirs = BlendedMegatronDatasetBuilder(mcore_gpt.GPTDataset, sizes, lambda: True, config).build()
    for a, t, n in zip(ours, theirs, sizes):
        assert len(a) == len(t)
        for i in range(n):
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(a[i][key].to(t[i][key].dtype), t[i][key]), (i, key)

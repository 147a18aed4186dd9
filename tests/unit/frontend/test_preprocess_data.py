"""tools/preprocess_data.py end to end: JSONL in, Megatron-named .bin/.idx out, read back by megatron-core's
``IndexedDataset`` (the tool keeps a light writer of its own: megatron/training/indexed_writer.py)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tests import ROOT

TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")

TEXTS = ["Hello world.", "", "Ünïcödé ✓", "a\nb", "last one"]


def run_tool(*flags, cwd=None):
    return subprocess.run([sys.executable, TOOL, *flags], capture_output=True, text=True, cwd=cwd, timeout=120)


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, [{"text": t, "title": f"t{i}"} for i, t in enumerate(TEXTS)])
    return path


def test_byte_tokenizer_end_to_end(tmp_path, corpus):
    out = tmp_path / "out" / "c"
    result = run_tool("--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "ByteTokenizer",
                      "--json-keys", "text", "title", "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    text = IndexedDataset(str(out) + "_text_document")
    expected = [list(t.encode("utf-8")) + [256] for t in TEXTS if t]
    assert [text[i].tolist() for i in range(len(text))] == expected
    assert text.index.dtype == np.uint16
    # the empty document adds a boundary but no sequence, as Megatron's builder does
    assert text.document_indices.tolist() == [0, 1, 1, 2, 3, 4]
    title = IndexedDataset(str(out) + "_title_document")
    assert [title[i].tolist() for i in range(len(title))] == [list(f"t{i}".encode()) + [256] for i in range(5)]


def test_output_does_not_depend_on_workers(tmp_path, corpus):
    outputs = []
    for workers in ("1", "3"):
        out = tmp_path / f"w{workers}"
        result = run_tool("--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "ByteTokenizer",
                          "--append-eod", "--workers", workers)
        assert result.returncode == 0, result.stderr
        outputs.append([open(f"{out}_text_document.{ext}", "rb").read() for ext in ("bin", "idx")])
    assert outputs[0] == outputs[1]


def test_null_tokenizer_and_no_eod(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    write_jsonl(corpus, [{"text": "1 2 3"}, {"text": " 7  8 "}, {"text": ["4 5", "", "6"]}])
    out = tmp_path / "ids"
    result = run_tool("--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "100", "--workers", "1")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(out) + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [7, 8], [4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 1, 2, 4]
    out = tmp_path / "eod"
    result = run_tool("--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "100", "--append-eod", "--workers", "1")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(out) + "_text_document")
    # eod = --vocab-size; a list value's eod goes after its last sequence
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 100], [7, 8, 100], [4, 5], [6, 100]]


@pytest.mark.parametrize(
    "records,flags,message",
    [
        ([{"body": "x"}], ["--tokenizer-type", "ByteTokenizer"], "line 1: no key 'text'"),
        ([{"text": "1 2"}, {"text": "1 x"}], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
         "line 2.*integer ids"),
        ([{"text": "1 12"}], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"], "outside"),
        ([{"text": "1"}], ["--tokenizer-type", "NullTokenizer"], "requires --vocab-size"),
        ([{"text": "1"}], ["--tokenizer-type", "SentencePieceTokenizer"], "invalid choice"),
        ([{"text": "1"}], ["--tokenizer-type", "GPT2BPETokenizer"], "requires --vocab-file"),
        ([{"text": "1"}], ["--tokenizer-type", "ByteTokenizer", "--split-sentences"], "--split-sentences"),
    ],
)
def test_errors(tmp_path, records, flags, message):
    corpus = tmp_path / "bad.jsonl"
    write_jsonl(corpus, records)
    result = run_tool("--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--workers", "1", *flags)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr


def test_missing_input(tmp_path):
    result = run_tool("--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "ByteTokenizer", "--workers", "1")
    assert result.returncode != 0 and "none.jsonl does not exist" in result.stderr


def test_huggingface_tokenizer_json(tmp_path):
    """A local tokenizer.json (built here, nothing downloaded) through the tool and build_tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))

    from megatron.training.tokenizer import build_tokenizer_from

    for model in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        built = build_tokenizer_from("HuggingFaceTokenizer", tokenizer_model=model)
        assert built.vocab_size == 5 and built.eod == 0
        assert built.tokenize("hello world zzz") == [2, 3, 1]
        assert built.detokenize([2, 4]) == "hello again"

    corpus = tmp_path / "c.jsonl"
    write_jsonl(corpus, [{"text": "hello world"}, {"text": "again"}])
    result = run_tool("--input", str(corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-type",
                      "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path), "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "hf_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[2, 3, 0], [4, 0]]


def test_huggingface_tokenizer_errors(tmp_path):
    from megatron.training.tokenizer import build_tokenizer_from

    with pytest.raises(ValueError, match="requires --tokenizer-model"):
        build_tokenizer_from("HuggingFaceTokenizer")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        build_tokenizer_from("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match="valid: NullTokenizer, ByteTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer"):
        build_tokenizer_from("SentencePieceTokenizer")


def test_null_and_byte_tokenizers():
    import argparse

    from megatron.training.tokenizer import build_tokenizer

    null = build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=50, tokenizer_model=None))
    assert (null.vocab_size, null.eod) == (51, 50)  # Megatron: eod = --vocab-size, one extra id
    assert null.tokenize("3 0  49") == [3, 0, 49]
    assert null.detokenize([3, 0, 49]) == "3 0 49"
    with pytest.raises(ValueError, match="id 50 is outside"):
        null.tokenize("50")
    byte = build_tokenizer(argparse.Namespace(tokenizer_type="ByteTokenizer", vocab_size=None, tokenizer_model=None))
    assert (byte.vocab_size, byte.eod) == (257, 256)
    assert byte.tokenize("aé") == [97, 195, 169]
    assert byte.detokenize(byte.tokenize("héllo ✓") + [256]) == "héllo ✓"

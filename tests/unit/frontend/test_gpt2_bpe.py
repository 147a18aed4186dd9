"""GPT2BPETokenizer (Megatron's ``--vocab-file``/``--merge-file``), run by Hugging Face ``tokenizers``, on tiny
hand-made GPT-2 files.

The expected splits are GPT-2's (its pattern with the ``regex`` package's ``\\p{L}``, ``\\p{N}`` and
``\\s``), worked out by hand; the merges are checked on words whose merge order matters.
"""

from __future__ import annotations

import json

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.errors import UsageError
from megatron.training.tokenizer import GPT2BPETokenizer, build_tokenizer

MERGES = [("l", "l"), ("h", "e"), ("he", "ll"), ("hell", "o"),
          ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
BYTE_CHARS = sorted(ByteLevel.alphabet())  # GPT-2's 256 printable stand-ins for the bytes


@pytest.fixture
def files(tmp_path):
    tokens = [*BYTE_CHARS, *(a + b for a, b in MERGES), "<|endoftext|>"]
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return str(vocab), str(merges)


def _pieces(tok: GPT2BPETokenizer, text: str) -> list[str]:
    """The text of each token of ``text`` (GPT-2's split shows where no merge joins bytes across pieces)."""
    return [tok.detokenize([i]) for i in tok.tokenize(text)]


def test_gpt2_pattern_splits_as_gpt2_does(files):
    tok = GPT2BPETokenizer(*files)
    # no merge crosses a piece of GPT-2's split: "Hello", " world", "'s", " 123", " !!", "\n\n ", " x"
    assert "".join(_pieces(tok, "Hello world's 123 !!\n\n  x")) == "Hello world's 123 !!\n\n  x"
    assert _pieces(tok, "hello world") == ["hello", " world"]
    assert _pieces(tok, "ahello") == ["a", "hello"]  # one piece, merged inside it
    assert _pieces(tok, "hel lo") == ["he", "l", " ", "l", "o"]  # two pieces: "l l" does not merge across them
    # \s is Unicode White_Space (U+3000 ideographic space is; U+001C is not): both round-trip
    assert tok.detokenize(tok.tokenize("a\u3000b\x1cc")) == "a\u3000b\x1cc"


def test_merges_apply_in_rank_order_and_ids_come_from_the_vocabulary(files):
    tok = GPT2BPETokenizer(*files)
    encoder = json.load(open(files[0]))
    assert tok.tokenize("hello world") == [encoder["hello"], encoder["Ġworld"]]
    assert tok.tokenize("hell") == [encoder["hell"]]
    # "ollo": ("l","l") is the only merge: o, ll, o
    assert tok.tokenize("ollo") == [encoder["o"], encoder["ll"], encoder["o"]]
    assert tok.eod == encoder["<|endoftext|>"] and tok.vocab_size == len(encoder) == 256 + len(MERGES) + 1


def test_any_text_round_trips_through_bytes(files):
    tok = GPT2BPETokenizer(*files)
    for text in ("hello world", "naïve café 42½ 🙂 汉字\n\t  end", "", "   "):
        assert tok.detokenize(tok.tokenize(text)) == text


def test_bad_files_are_named(files, tmp_path):
    vocab, merges = files
    with pytest.raises(UsageError, match="requires --merge-file"):
        GPT2BPETokenizer(vocab, None)
    with pytest.raises(UsageError, match="--vocab-file .*nothing.json does not exist"):
        GPT2BPETokenizer(str(tmp_path / "nothing.json"), merges)
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({c: i for i, c in enumerate(BYTE_CHARS)} | {a + b: 256 + i for i, (a, b) in
                                                                             enumerate(MERGES)}))
    with pytest.raises(UsageError, match="has no <\\|endoftext\\|>"):
        GPT2BPETokenizer(str(no_eod), merges)
    # a vocabulary without the merged tokens its merges file produces
    bytes_only = tmp_path / "bytes_only.json"
    bytes_only.write_text(json.dumps({**{c: i for i, c in enumerate(BYTE_CHARS)}, "<|endoftext|>": 256}))
    with pytest.raises(UsageError, match="are not a GPT-2 vocab.json and merges.txt pair"):
        GPT2BPETokenizer(str(bytes_only), merges)


def test_megatron_command_lines_select_it_from_the_two_files(files):
    vocab, merges = files
    args = validate_args(parse_args(["--mock-data", "--vocab-file", vocab, "--merge-file", merges]), 1)
    assert args.tokenizer_type == "GPT2BPETokenizer" and build_tokenizer(args).vocab_size == 256 + len(MERGES) + 1
    with pytest.raises(ArgumentError, match="--vocab-file and --merge-file are read only by --tokenizer-type "
                                            "GPT2BPETokenizer, not by --tokenizer-type ByteTokenizer"):
        validate_args(parse_args(["--mock-data", "--tokenizer-type", "ByteTokenizer", "--vocab-file", vocab,
                                  "--merge-file", merges]), 1)

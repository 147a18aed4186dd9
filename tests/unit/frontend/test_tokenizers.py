"""The tokenizers the front-end keeps of its own (tokenizer.py says why): NullTokenizer numbers ids as
megatron-core's NullTokenizer; ByteTokenizer's numbering, which its data and checkpoints depend on."""

import pytest
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as McoreNullTokenizer

from megatron.training.errors import UsageValueError
from megatron.training.tokenizer import ByteTokenizer, NullTokenizer


def test_null_tokenizer_numbers_ids_as_megatron_cores():
    ours, theirs = NullTokenizer(50), McoreNullTokenizer(50)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (51, 50)
    assert ours.tokenize("3 1 49") == theirs.text_to_ids("3 1 49") == [3, 1, 49]
    assert ours.detokenize([3, 1, 49]) == theirs.ids_to_text([3, 1, 49])
    with pytest.raises(ValueError, match="outside \\[0, --vocab-size=50\\)"):
        ours.tokenize("50")  # megatron-core's accepts it: the embedding would fail later
    with pytest.raises(UsageValueError, match="give --vocab-size N"):
        NullTokenizer(None)


def test_byte_tokenizer_is_the_bytes_with_eod_256():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.tokenize("aé") == [97, 0xC3, 0xA9] and tok.detokenize([97, 0xC3, 0xA9, 256]) == "aé"
    assert tok.unique_identifiers == {"class": "ByteTokenizer"}

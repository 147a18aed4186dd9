"""Megatron's ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` and ``--merge-file``.

The files are GPT-2's ``vocab.json`` (token string -> id) and ``merges.txt`` (a ``#version``
line, then one merge per line, best first), as Megatron-LM reads them. The algorithm is
GPT-2's: the text is split by GPT-2's pattern, each piece's UTF-8 bytes are mapped to
printable characters (``bytes_to_unicode``), the piece is merged pair by pair in merge-rank
order, and each resulting token is looked up in the vocabulary. ``eod`` is
``<|endoftext|>``'s id and ``vocab_size`` the vocabulary's length, as in Megatron-LM.

GPT-2's pattern uses ``\\p{L}`` (letters), ``\\p{N}`` (numbers) and ``\\s`` (Unicode
White_Space) from the ``regex`` package, which this front-end does not need: the same
character classes are built once from ``unicodedata`` (letters: categories L*; numbers: N*),
and White_Space is its fixed list of 25 code points, so Python's ``re`` splits text exactly as
GPT-2's pattern does (up to the Unicode version of Python's ``unicodedata``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import unicodedata
from collections.abc import Sequence

from .errors import UsageFileNotFoundError, UsageValueError

EOD_TOKEN = "<|endoftext|>"
# Unicode's White_Space property (PropList.txt), which the regex package's \s matches.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _char_class(prefix: str) -> str:
    """A ``re`` character-class body matching every code point whose general category starts with ``prefix``."""
    ranges: list[tuple[int, int]] = []
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)).startswith(prefix):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


@functools.cache
def gpt2_pattern() -> re.Pattern[str]:
    """GPT-2's pre-tokenization pattern.

    ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
    """
    letters, numbers, space = _char_class("L"), _char_class("N"), _WHITE_SPACE
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (printable Latin-1 bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE (Megatron's ``--tokenizer-type GPT2BPETokenizer``)."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise UsageValueError(f"--tokenizer-type GPT2BPETokenizer requires {flag} (GPT-2's "
                                      f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'}, a local file)")
            if not os.path.isfile(path):
                raise UsageFileNotFoundError(f"{flag} {path} does not exist (nothing is downloaded)")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise UsageValueError(f"--vocab-file {vocab_file} is not GPT-2's vocab.json (JSON): {error}") from None
        if not isinstance(self.encoder, dict) or not all(isinstance(v, int) for v in self.encoder.values()):
            raise UsageValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> integer id")
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        merges = []
        for number, line in enumerate(lines[1:] if lines and lines[0].startswith("#version") else lines, 2):
            if not line.strip():
                continue
            pair = line.split()
            if len(pair) != 2:
                raise UsageValueError(f"--merge-file {merge_file}: line {number} is not two tokens: {line!r}")
            merges.append(tuple(pair))
        self.ranks: dict[tuple[str, str], int] = {pair: rank for rank, pair in enumerate(merges)}
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        if EOD_TOKEN not in self.encoder:
            raise UsageValueError(f"--vocab-file {vocab_file} has no {EOD_TOKEN} (GPT-2's end-of-document token)")
        self._cache: dict[str, list[str]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[EOD_TOKEN]

    def _bpe(self, piece: str) -> list[str]:
        """``piece`` (byte-mapped characters) merged in rank order: the lowest-ranked adjacent pair first."""
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = list(piece)
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda pair: self.ranks.get(pair, len(self.ranks)))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self._cache[piece] = word
        return word

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for piece in gpt2_pattern().findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for token in self._bpe(mapped):
                if token not in self.encoder:
                    raise UsageValueError(f"GPT2BPETokenizer: the merges produce {token!r}, which --vocab-file "
                                          "lacks (the vocabulary and merges files do not belong together)")
                ids.append(self.encoder[token])
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

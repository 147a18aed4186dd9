"""Tokenizers selected by Megatron's ``--tokenizer-type``, with Megatron's id conventions.

* ``NullTokenizer`` (Megatron's): text is space-separated integer ids in ``[0, --vocab-size)``;
  the end-of-document id is ``--vocab-size`` itself, so ``vocab_size`` is ``--vocab-size + 1``.
* ``ByteTokenizer`` (ours, works offline with no files): ids 0..255 are the UTF-8 bytes of the
  text, the end-of-document id is 256, ``vocab_size`` is 257. ``--vocab-size`` is ignored.
* ``GPT2BPETokenizer`` (Megatron's): GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json)
  and ``--merge-file`` (merges.txt), local files (``gpt2_bpe.py``); ``eod`` is ``<|endoftext|>``.
  Megatron-LM's configurations pass the two files without ``--tokenizer-type``: given both and
  no type, this tokenizer is used.
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local ``tokenizer.json`` (or a directory
  holding one), read with ``tokenizers``, or a saved ``transformers`` tokenizer directory (with
  ``tokenizer_config.json``), read with ``AutoTokenizer``. Nothing is downloaded. ``eod`` is the
  tokenizer's end-of-sequence token; ``vocab_size`` counts added tokens.

Every tokenizer exposes ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eod``, ``tokenize(text)``
and ``detokenize(ids)``. The trainer pads ``vocab_size`` for the embedding table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .errors import UsageValueError
from .gpt2_bpe import GPT2BPETokenizer

TOKENIZER_TYPES = ("NullTokenizer", "ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")


class NullTokenizer:
    """Megatron's ``_NullTokenizer``: the text already is the ids."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None:
            raise UsageValueError(
                "give --vocab-size N: the number of token ids (--mock-data draws ids below N; the ids in --data-path "
                "files must be below N). The default --tokenizer-type NullTokenizer (text is ids) requires "
                "--vocab-size; --tokenizer-type ByteTokenizer, or HuggingFaceTokenizer with --tokenizer-model, "
                "bring their own vocabulary"
            )
        if int(vocab_size) < 1:
            raise UsageValueError(f"--tokenizer-type NullTokenizer requires --vocab-size >= 1, got {vocab_size}")
        self._text_vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._text_vocab_size + 1

    @property
    def eod(self) -> int:
        return self._text_vocab_size

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects space-separated integer ids, got {word!r}; "
                    "use --tokenizer-type ByteTokenizer for raw text"
                ) from None
            if not 0 <= value < self._text_vocab_size:
                raise ValueError(
                    f"NullTokenizer: id {value} is outside [0, --vocab-size={self._text_vocab_size}) "
                    f"(id {self._text_vocab_size} is reserved for end-of-document)"
                )
            ids.append(value)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as ids; needs no vocabulary file, so preprocessing and training work offline."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer: ``tokenizers`` for a bare tokenizer.json, else ``AutoTokenizer``."""

    def __init__(self, model_path: str) -> None:
        if not model_path:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer requires --tokenizer-model (a local path)")
        if not os.path.exists(model_path):
            raise FileNotFoundError(
                f"--tokenizer-model {model_path} does not exist (a local tokenizer directory or tokenizer.json "
                "is required; nothing is downloaded)"
            )
        self._hf: Any = None
        self._fast: Any = None
        json_path = model_path if os.path.isfile(model_path) else os.path.join(model_path, "tokenizer.json")
        has_config = os.path.isdir(model_path) and os.path.isfile(os.path.join(model_path, "tokenizer_config.json"))
        if has_config or not os.path.isfile(json_path):
            try:
                import transformers
            except ImportError:
                raise ImportError(
                    f"--tokenizer-model {model_path} needs `transformers` (no bare tokenizer.json to read with "
                    "`tokenizers`)"
                ) from None
            self._hf = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        else:
            try:
                import tokenizers
            except ImportError:
                raise ImportError(
                    "--tokenizer-type HuggingFaceTokenizer needs `tokenizers` (or `transformers`) installed"
                ) from None
            self._fast = tokenizers.Tokenizer.from_file(json_path)
        eod = self._hf.eos_token_id if self._hf is not None else self._find_eos_in_vocab()
        if eod is None:
            raise ValueError(f"--tokenizer-model {model_path}: the tokenizer defines no end-of-sequence token")
        self._eod = int(eod)

    def _find_eos_in_vocab(self) -> int | None:
        for name in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"):
            token_id = self._fast.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=False)["input_ids"])
        return list(self._fast.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._fast.decode(ids)


Tokenizer = NullTokenizer | ByteTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer


def build_tokenizer_from(
    tokenizer_type: str, vocab_size: int | None = None, tokenizer_model: str | None = None,
    vocab_file: str | None = None, merge_file: str | None = None,
) -> Tokenizer:
    """Build a tokenizer from explicit settings (the preprocessing tool and tests use this)."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; valid: {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(args: Any) -> Tokenizer:
    """Build the tokenizer named by ``args.tokenizer_type`` (reads ``vocab_size``, ``tokenizer_model``,
    ``vocab_file``, ``merge_file``)."""
    return build_tokenizer_from(
        getattr(args, "tokenizer_type", "NullTokenizer") or "NullTokenizer",
        getattr(args, "vocab_size", None),
        getattr(args, "tokenizer_model", None),
        getattr(args, "vocab_file", None),
        getattr(args, "merge_file", None),
    )


def resolve_tokenizer_files(args: Any, given: Callable[[str], bool], fail: Callable[[str], None]) -> None:
    """``--vocab-file``/``--merge-file``: GPT-2 BPE's files; with no ``--tokenizer-type`` they select it.

    ``given(flag)``: whether the flag was on the command line. Files given for another tokenizer
    would be silently unused, so that stops, naming both flags.
    """
    files = [f for f, v in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)) if v is not None]
    if not files:
        return
    if not given("--tokenizer-type"):
        args.tokenizer_type = "GPT2BPETokenizer"  # Megatron-LM's configurations give the files alone
    elif args.tokenizer_type != "GPT2BPETokenizer":
        names = " and ".join(files)
        fail(f"{names} {'is' if len(files) == 1 else 'are'} read only by --tokenizer-type GPT2BPETokenizer, not by "
             f"--tokenizer-type {args.tokenizer_type}; drop {names} or choose GPT2BPETokenizer")

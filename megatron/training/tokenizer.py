"""Tokenizers selected by Megatron's ``--tokenizer-type``, with Megatron's id conventions.

* ``NullTokenizer`` (Megatron's): text is space-separated integer ids in ``[0, --vocab-size)``;
  the end-of-document id is ``--vocab-size`` itself, so ``vocab_size`` is ``--vocab-size + 1``.
* ``ByteTokenizer`` (ours, works offline with no files): ids 0..255 are the UTF-8 bytes of the
  text, the end-of-document id is 256, ``vocab_size`` is 257. ``--vocab-size`` is ignored.
* ``GPT2BPETokenizer`` (Megatron's): GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json)
  and ``--merge-file`` (merges.txt), local files, run by Hugging Face ``tokenizers`` (its BPE
  model with GPT-2's byte-level pre-tokenizer and decoder); ``eod`` is ``<|endoftext|>``.
  Megatron-LM's configurations pass the two files without ``--tokenizer-type``: given both and
  no type, this tokenizer is used. (megatron-core 0.16.1's ``GPT2BPETokenizer`` cannot serve:
  it asks the model hub for ``gpt2/config.json``, failing offline, and passes the vocabulary
  file as the merges file.)
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local ``tokenizer.json`` (or a directory
  holding one), read with ``tokenizers``, or a saved ``transformers`` tokenizer directory (with
  ``tokenizer_config.json``), read with ``AutoTokenizer``. Nothing is downloaded. ``eod`` is the
  tokenizer's end-of-sequence token; ``vocab_size`` counts added tokens.

Every tokenizer exposes ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eod``, ``tokenize(text)``,
``detokenize(ids)`` and ``unique_identifiers`` (what megatron-core's datasets hash into their
cache names). The trainer pads ``vocab_size`` for the embedding table.

``NullTokenizer`` and ``ByteTokenizer`` are the front-end's own, a few lines each: the
preprocessing tool and ``arguments.py`` import this module, and must start without megatron-core
(it takes seconds to import; tests/unit/frontend/test_frontend_arguments.py validates flags
where megatron-core is blocked). ``NullTokenizer`` numbers ids as megatron-core's (checked by
tests/unit/frontend/test_tokenizers.py) and rejects ids outside the vocabulary; megatron-core's
``ByteLevelTokenizer`` numbers its special tokens differently (eos 0, the NUL byte's id; pad 1;
vocabulary 512: see docs/data.md), and data and checkpoints of ``--tokenizer-type ByteTokenizer``
depend on ours (eod 256, vocabulary 257).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .errors import UsageFileNotFoundError, UsageValueError

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

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What megatron-core's datasets hash of the tokenizer."""
        return {"class": "NullTokenizer", "vocab_size": self._text_vocab_size}


class ByteTokenizer:
    """UTF-8 bytes as ids; needs no vocabulary file, so preprocessing and training work offline."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What megatron-core's datasets hash of the tokenizer."""
        return {"class": "ByteTokenizer"}


EOD_TOKEN = "<|endoftext|>"


def _tokenizers_package(what: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError(f"{what} needs Hugging Face `tokenizers` (pip install tokenizers; the front-end's "
                          "`training` extra installs it)") from None
    return tokenizers


class GPT2BPETokenizer:
    """Megatron's ``GPT2BPETokenizer``: GPT-2's byte-level BPE from local ``vocab.json`` and ``merges.txt``.

    Run by Hugging Face ``tokenizers``: ``models.BPE.from_file(vocab, merges)`` with GPT-2's
    byte-level pre-tokenizer (its split pattern, bytes mapped to printable characters) and
    decoder. ``eod`` is ``<|endoftext|>``'s id and ``vocab_size`` the vocabulary's length, as in
    Megatron-LM.
    """

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        files = (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file, "merges.txt"))
        for flag, path, name in files:
            if not path:
                raise UsageValueError(
                    f"--tokenizer-type GPT2BPETokenizer requires {flag} (GPT-2's {name}, a local file)")
            if not os.path.isfile(path):
                raise UsageFileNotFoundError(f"{flag} {path} does not exist (nothing is downloaded)")
        tokenizers = _tokenizers_package("--tokenizer-type GPT2BPETokenizer")
        try:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # tokenizers raises its own Exception type, with the reason
            raise UsageValueError(f"--vocab-file {vocab_file} and --merge-file {merge_file} are not a GPT-2 "
                                  f"vocab.json and merges.txt pair: {error}") from None
        self._tokenizer = tokenizers.Tokenizer(model)
        self._tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = tokenizers.decoders.ByteLevel()
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise UsageValueError(f"--vocab-file {vocab_file} has no {EOD_TOKEN} (GPT-2's end-of-document token)")
        self._eod = int(eod)
        self._files = (os.path.abspath(vocab_file), os.path.abspath(merge_file))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What megatron-core's datasets hash of the tokenizer."""
        return {"class": "GPT2BPETokenizer", "vocab_file": self._files[0], "merge_file": self._files[1]}


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
        self._model_path = os.path.abspath(model_path)
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

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """What megatron-core's datasets hash of the tokenizer."""
        return {"class": "HuggingFaceTokenizer", "model": self._model_path}


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

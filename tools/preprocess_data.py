"""Tokenize a JSONL corpus into Megatron's indexed dataset format (``.bin``/``.idx``).

Same flags and output names as Megatron-LM's ``tools/preprocess_data.py``::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteTokenizer --json-keys text --append-eod --workers 2

writes ``data/corpus_text_document.bin`` and ``data/corpus_text_document.idx`` (one pair per JSON
key), which ``pretrain_gpt.py --data-path data/corpus_text_document`` reads. Each JSON line is one
document; with ``--append-eod`` the tokenizer's end-of-document id ends every non-empty one. The
output is identical for any ``--workers`` (documents keep their input order).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.indexed_writer import IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer_from  # noqa: E402

_TOKENIZER = None
_ARGS = None


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's preprocessing flags (the subset that applies to document-level data)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True, help="path to the input JSONL file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one output each")
    group.add_argument("--split-sentences", action="store_true", help="not supported (needs nltk)")
    group.add_argument("--keep-newlines", action="store_true", help="only used with --split-sentences")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", type=str, default=None, help="local HuggingFaceTokenizer path")
    group.add_argument("--vocab-size", type=int, default=None, help="ids per NullTokenizer (eod = vocab size)")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    group.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1, help="only 1 is supported")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument("--keep-sequential-samples", action="store_true", help="accepted; order is always kept")
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported (it needs nltk); documents are kept whole")
    if args.partitions != 1:
        parser.error(f"--partitions {args.partitions}: only 1 is supported; use --workers for parallelism")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        parser.error("--tokenizer-type NullTokenizer requires --vocab-size")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        parser.error("--tokenizer-type GPT2BPETokenizer requires --vocab-file (vocab.json) and --merge-file "
                     "(merges.txt)")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input} does not exist")
    return args


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER, _ARGS
    _ARGS = args
    _TOKENIZER = build_tokenizer_from(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                                     args.merge_file)


def encode(numbered_line: tuple[int, str]) -> tuple[dict[str, list[list[int]]] | None, int]:
    """Sequences of token ids per JSON key of one line (None for a blank line), and its byte count.

    A string value is one sequence; a list of strings gives one sequence per non-empty item, as
    Megatron does. ``--append-eod`` appends the eod id to the last sequence of a non-empty document.
    """
    lineno, line = numbered_line
    if not line.strip():
        return None, len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"--input line {lineno}: not valid JSON ({error})") from None
    ids = {}
    for key in _ARGS.json_keys:
        if key not in record:
            raise ValueError(f"--input line {lineno}: no key {key!r} (--json-keys {' '.join(_ARGS.json_keys)})")
        value = record[key]
        texts = value if isinstance(value, list) else [value]
        try:
            sequences = [tokens for tokens in (_TOKENIZER.tokenize(str(t)) for t in texts) if tokens]
        except ValueError as error:
            raise ValueError(f"--input line {lineno}, key {key!r}: {error}") from None
        if sequences and _ARGS.append_eod:
            sequences[-1].append(_TOKENIZER.eod)
        ids[key] = sequences
    return ids, len(line)


class _Serial:
    """In-process stand-in for ``multiprocessing.Pool`` when ``--workers 1``."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def imap(self, fn, iterable, chunksize: int = 1):
        return map(fn, iterable)


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's output naming: ``PREFIX_{key}_document``."""
    return f"{prefix}_{key}_document"


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    _init_worker(args)
    dtype = optimal_dtype(_TOKENIZER.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    builders = {key: IndexedDatasetBuilder(output_prefix(args.output_prefix, key) + ".bin", dtype)
                for key in args.json_keys}
    start, documents, total_bytes = time.time(), 0, 0
    with open(args.input, encoding="utf-8") as lines:
        numbered = enumerate(lines, start=1)
        with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,)) if args.workers > 1 \
                else _Serial() as pool:
            for ids, nbytes in pool.imap(encode, numbered, chunksize=32):
                total_bytes += nbytes
                if ids is None:
                    continue
                for key, sequences in ids.items():
                    # an empty document adds no sequence, only a document boundary (as Megatron does)
                    for tokens in sequences:
                        builders[key].add_item(tokens)
                    builders[key].end_document()
                documents += 1
                if documents % args.log_interval == 0:
                    elapsed = max(time.time() - start, 1e-9)
                    print(f"Processed {documents} documents ({documents / elapsed:.1f} docs/s, "
                          f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)
    for key, builder in builders.items():
        builder.finalize(output_prefix(args.output_prefix, key) + ".idx")
        print(f"Wrote {output_prefix(args.output_prefix, key)}.bin/.idx: {documents} documents, "
              f"{sum(builder.sequence_lengths)} tokens, dtype {builder.dtype.__name__}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, ImportError, FileNotFoundError) as error:
        sys.exit(f"preprocess_data.py: error: {error}")

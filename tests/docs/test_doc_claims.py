"""Claims of the docs that can be checked mechanically: flags documented, quoted error messages real.

- Every flag ``pretrain_gpt.py`` accepts (the parser of ``megatron/training/arguments.py``,
  whatever flags it grows) appears in docs/megatron.md, as the README promises.
- Every error message the docs quote as ``error: ...`` (in a code span; the form
  ``pretrain_gpt.py`` prints user errors in) is one the code can raise: it matches a string
  literal or f-string of the code, each ``{...}`` of which stands for any value (the docs
  write ``DIR``, ``N`` or an example value there); a ``...`` marks where the quote stops
  (it must stop in the text of the message, not in a value).
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re

import pytest

from megatron.training.arguments import build_parser
from tests import ROOT

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
CODE_DIRS = ("megatron", "megatron_fsdp", "tools")
VALUE = None  # a {...} of an f-string: any text


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _flags() -> list[str]:
    flags = {o for action in build_parser()._actions for o in action.option_strings}
    return sorted(f for f in flags if f.startswith("--") and f != "--help")


def test_every_flag_is_in_megatron_md():
    doc = _read("docs/megatron.md")
    missing = [flag for flag in _flags() if not re.search(re.escape(flag) + r"(?![\w-])", doc)]
    assert not missing, f"flags of megatron/training/arguments.py missing from docs/megatron.md: {missing}"


@functools.cache
def _templates() -> list[list[str | None]]:
    """Every string literal of the code, as pieces: text, or VALUE for an f-string's ``{...}``."""
    files = [os.path.join(ROOT, "pretrain_gpt.py")]
    for folder in CODE_DIRS:
        files += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append([node.value])
            elif isinstance(node, ast.JoinedStr):
                out.append([v.value if isinstance(v, ast.Constant) else VALUE for v in node.values])
    return out


def _matches(text: str, pieces: list[str | None]) -> bool:
    """Whether ``text`` is the start of a string ``pieces`` can make: a VALUE is any non-empty text
    followed by the next piece (a quote may stop inside a piece of text, not inside a value)."""
    if not text:
        return True
    if not pieces:
        return False
    head, rest = pieces[0], pieces[1:]
    if head is VALUE:
        return bool(rest) and any(_matches(text[cut:], rest) for cut in range(1, len(text)))
    if text.startswith(head):
        return _matches(text[len(head):], rest)
    return head.startswith(text)  # the quote stops inside this piece


def _quoted_errors() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for message in re.findall(r"`error: ([^`]+)`", _read(path)):
            found.append((path, message))
    return found


def test_the_docs_quote_error_messages():
    assert len(_quoted_errors()) >= 5  # the convention is in use (docs/megatron.md, "Start-up checks")


@pytest.mark.parametrize("path, message", _quoted_errors())
def test_quoted_error_message_exists_in_the_code(path, message):
    quote = message.split("...")[0].rstrip()
    templates = _templates()
    assert any(_matches(quote, t) for t in templates), (
        f"{path} quotes the error {message!r}, which no string of the code can produce; fix the docs or the code")


def test_matcher_accepts_values_and_stops_and_rejects_other_words():
    template = ["--save ", VALUE, " already holds a checkpoint of iteration ", VALUE, " (", VALUE, ") and more"]
    assert _matches("--save DIR already holds a checkpoint of iteration 60 (tracker.txt) and more", template)
    assert _matches("--save DIR already holds a check", template)
    assert not _matches("--save DIR already has a checkpoint", template)
    assert not _matches("--load DIR already holds a checkpoint", template)

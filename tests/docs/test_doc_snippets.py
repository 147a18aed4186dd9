"""The docs cannot drift from the code: every marked example of README.md and docs/*.md runs on gloo ranks.

The convention (``# doc-test: ranks=N [setup=NAME]``) is in tests/docs/doc_checks.py and
docs/api.md ("Examples in the docs are tested").
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import pytest_suite
from tests.docs import doc_checks

results, test_doc_example = pytest_suite(doc_checks, world_sizes=doc_checks.WORLD_SIZES)


def test_examples_are_marked_and_compile() -> None:
    by_file = {}
    for block in doc_checks.BLOCKS:
        compile(block.code, f"{block.path}:{block.line}", "exec")
        by_file.setdefault(block.path, []).append(block.line)
    # The user-facing entry points must stay tested (the files whose examples are runnable on CPU).
    for path in ("README.md", "docs/api.md", "docs/whole_model_api.md", "docs/training.md"):
        assert path in by_file, f"{path} has no doc-test example"


@pytest.mark.parametrize("marker, fragment", [
    ("ranks=two", "must be a positive integer"),
    ("ranks=2 setup=gpu", "is not one of"),
    ("setup=model", "write 'ranks=N'"),
    ("ranks=2 quick", "write 'ranks=N'"),
])
def test_bad_markers_are_named(marker: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        doc_checks.parse_marker(marker, "docs/x.md:3")
    assert "docs/x.md:3" in str(info.value)

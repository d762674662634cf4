"""docs/integrations.md's copied examples are code the tests run: each block says where.

A Python code block right after ``<!-- tested in tests/<file>.py -->`` must be made of
lines of that file, in the same order (indentation aside; blank lines, whole-line comments and
``...`` lines of the block are free), so an example cannot drift away from what the test runs.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
_BLOCK = re.compile(r"<!-- tested in (\S+) -->\s*\n```python\n(.*?)```", re.S)


def doc_examples(doc: Path = DOC) -> list[tuple[str, str]]:
    """``(test file, code)`` for every marked block of ``doc``."""
    return _BLOCK.findall(doc.read_text())


def assert_doc_examples_run_in_tests(test_file: str, doc: Path = DOC) -> None:
    """Every block of ``doc`` marked with ``test_file`` is a subsequence of its lines.

    Raises:
        AssertionError: no block names ``test_file``, or a line of one is not found (in order).
    """
    blocks = [code for path, code in doc_examples(doc) if path == test_file]
    assert blocks, f"no example of {doc.name} is marked '<!-- tested in {test_file} -->'"
    source = [line.strip() for line in (ROOT / test_file).read_text().splitlines()]
    for code in blocks:
        position = 0
        for line in (raw.strip() for raw in code.splitlines()):
            if not line or line.startswith("#") or line == "...":
                continue
            try:
                position = source.index(line, position) + 1
            except ValueError:
                raise AssertionError(
                    f"{doc.name}: the example line {line!r} is not in {test_file} "
                    "(after the block's previous lines)"
                ) from None

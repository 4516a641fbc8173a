"""Markdown for the reports the jobs write: a table, and the ``<!-- name -->`` ... ``<!-- /name -->`` blocks of a
README or a docs page that a finished run rewrites (bench, bench-serve, soak).

>>> print(markdown_table(["method", "speedup"], [["ngram", "1.4x"]]))
| method | speedup |
|---|---|
| ngram | 1.4x |
"""

from __future__ import annotations

from pathlib import Path


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def check_block(path: Path, name: str) -> tuple[str, str, str]:
    """(text, begin, end) of ``path`` with its ``<!-- name -->`` ... ``<!-- /name -->`` block; ValueError without it."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    text = Path(path).read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no {begin} ... {end} block to rewrite")
    return text, begin, end


def replace_block(path: Path, name: str, body: str) -> None:
    """Rewrite what lies between ``<!-- name -->`` and ``<!-- /name -->`` in ``path``; ValueError without them."""
    text, begin, end = check_block(path, name)
    Path(path).write_text(text[: text.index(begin)] + f"{begin}\n{body}\n{end}" + text[text.index(end) + len(end) :])

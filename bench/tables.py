"""Markdown pieces of ``docs/benchmarks.md``: byte and time figures, cells and tables."""
from __future__ import annotations


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def ms(n: float) -> str:
    return f"{n:,.1f} ms"


def cell(value) -> str:
    """A table cell: a pipe or a line break inside a value (an error message) would break the row."""
    return " ".join(str(value).split()).replace("|", "\\|")


def table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines

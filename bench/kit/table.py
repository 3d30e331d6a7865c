"""The figure table: the Markdown table a benchmark prints its figures as, and its cells.

A table has a header and rows of cells. A benchmark that prints rows as they are measured prints
:attr:`Table.head` first, then each :meth:`Table.row`; one that prints at the end adds rows and
prints the table. :func:`cell` writes a figure that may be missing.
"""

from __future__ import annotations

import math

__all__ = ["Table", "cell"]


def cell(value: float | None, spec: str, *, scale: float = 1.0, missing: str = "n/a") -> str:
    """``value`` times ``scale`` in the format ``spec``; ``missing`` for None or NaN (a figure
    not measured)."""
    if value is None or math.isnan(value):
        return missing
    return format(value * scale, spec)


class Table:
    """A Markdown table.

    Args:
        columns: The header's cells.
    """

    def __init__(self, *columns: str) -> None:
        self.columns = columns
        self.rows: list[str] = []

    @property
    def head(self) -> str:
        """The header row and the line under it."""
        return self.row(*self.columns) + "\n|" + "---|" * len(self.columns)

    def row(self, *cells: object) -> str:
        """One row of ``cells`` (each written with ``str``)."""
        return "| " + " | ".join(map(str, cells)) + " |"

    def add(self, *cells: object) -> None:
        """Add a row, printed with the table."""
        self.rows.append(self.row(*cells))

    def __str__(self) -> str:
        return "\n".join([self.head, *self.rows])

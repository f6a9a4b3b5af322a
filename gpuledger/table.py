"""Text tables whose columns are as wide as their widest cell (ids and names are never cut or glued)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]

GAP = "  "


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[str] = ()) -> list[str]:
    """The lines of a table: one header line, one per row; columns named in ``right`` align right.
    The last column is not padded (no trailing blanks)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    last = len(headers) - 1

    def line(values: Sequence[str]) -> str:
        out = []
        for i, (value, width) in enumerate(zip(values, widths, strict=True)):
            if headers[i] in right:
                out.append(value.rjust(width))
            else:
                out.append(value if i == last else value.ljust(width))
        return GAP.join(out).rstrip()

    return [line(list(headers)), *(line(r) for r in cells)]

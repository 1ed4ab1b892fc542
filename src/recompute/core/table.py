"""Units and plain text tables: the one place that knows what a GiB is and how a column is aligned.

Standard library only, so every floor (and ``recompute estimate``, which imports no torch) can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["GiB", "KiB", "MiB", "gib", "mib", "render_table", "size"]

KiB = 2**10
MiB = 2**20
GiB = 2**30


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def mib(n: float, *, digits: int = 1) -> str:
    """Bytes as MiB with thousands separators: ``1,242.0 MiB``."""
    return f"{n / MiB:,.{digits}f} MiB"


def size(n: float) -> str:
    """Bytes with four significant digits in B, KiB, MiB or GiB; ``-`` for zero."""
    if n == 0:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}" if n / scale < 1000 else f"{n / scale:,.0f} {unit}"
    return f"{n:.0f} B"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Align columns: first column left, the rest right."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])

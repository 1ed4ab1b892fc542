"""The progress callback long-running functions take: ``progress(label, done, total)``.

Library functions only call it; the front end decides how to show it (``recompute.progress``: a rich
bar on a terminal, a plain line now and then in a log).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "no_progress"]

Progress = Callable[[str, int, int], None]
"""``(what is running now, units done, units in all)``."""


def no_progress(label: str, done: int, total: int) -> None:
    """The default: show nothing."""

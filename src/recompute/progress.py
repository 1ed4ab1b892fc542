"""Progress for the long commands (trace, validate, bench, train) and the Python API (``recompute.plan``,
``recompute.profile``: ``progress=``): a rich bar on a terminal, plain lines in a log.

On a terminal (stderr is a TTY) the bar redraws in place; otherwise a line goes to stderr at most every
``PLAIN_EVERY_S`` seconds and at the end, so that a log holds no carriage returns and no flood. Both say how long
the rest should take, at the pace so far (a first calibration under load took minutes without a word, issue 38).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Literal

from recompute.core.errors import ConfigError
from recompute.core.progress import Progress, no_progress

__all__ = ["PLAIN_EVERY_S", "ProgressArg", "progress_bar", "shown_progress"]

ProgressArg = Progress | bool | Literal["auto"]
"""What the Python API's ``progress=`` takes: a callback, True (shown), False (silent) or ``"auto"``."""

PLAIN_EVERY_S = 5.0


@contextlib.contextmanager
def progress_bar(name: str, *, enabled: bool = True) -> Iterator[Progress]:
    """A ``Progress`` callback for the duration of the block; silent when not ``enabled`` (e.g. ``--json``)."""
    if not enabled:
        yield no_progress
    elif sys.stderr.isatty():
        with _rich_bar(name) as show:
            yield show
    else:
        yield _plain_lines(name)


@contextlib.contextmanager
def shown_progress(name: str, progress: ProgressArg) -> Iterator[Progress]:
    """The Python API's ``progress=`` as a callback for the block: a callable as it is; ``"auto"`` the command
    line's bar when stderr is a terminal, silent otherwise (a notebook's or a job's log); True the bar on a
    terminal and plain lines in a log (``progress_bar``); False silent.

    Raises:
        ConfigError: anything else.
    """
    if callable(progress):
        yield progress
        return
    if progress not in (True, False, "auto"):
        raise ConfigError(f"progress must be a callback (label, done, total), True, False or 'auto'; got {progress!r}")
    with progress_bar(name, enabled=sys.stderr.isatty() if progress == "auto" else bool(progress)) as show:
        yield show


@contextlib.contextmanager
def _rich_bar(name: str) -> Iterator[Progress]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn(f"{name}: {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=None)

        def show(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        yield show


def _plain_lines(name: str) -> Progress:
    last, start = [0.0], [time.monotonic()]

    def show(label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == 0:
            last[0] = start[0] = now  # nothing done yet: a line now would say nothing (and would precede a refusal)
        elif now - last[0] >= PLAIN_EVERY_S or done >= total:
            last[0] = now
            left = (now - start[0]) * (total - done) / done
            pace = f" (about {left:.0f} s left)" if done < total and now - start[0] >= PLAIN_EVERY_S else ""
            try:
                print(f"{name}: {done}/{total} {label}{pace}", file=sys.stderr, flush=True)
            except BrokenPipeError:
                # The reader has gone (``2>&1 | head``): the work goes on (a training run must reach its
                # checkpoint), and this and later lines go to /dev/null, as ``main_exit`` does for stdout.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())

    return show

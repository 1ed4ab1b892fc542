"""The files of a run in ``--out``: what is there, whether a new run may start, atomic writes, the metrics log.

A run writes ``metrics.jsonl`` (one JSON object per step), ``checkpoints/`` and ``sample.txt``. A new run
never mixes its files with an earlier run's: without ``--resume`` it starts only in an ``--out`` that holds
no run, or with ``--overwrite``, which deletes the earlier run's files first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from recompute.core.errors import ConfigError
from recompute.train.config import TrainConfig

__all__ = [
    "CHECKPOINTS",
    "METRICS",
    "SAMPLE",
    "append_metrics",
    "atomic_write",
    "check_out",
    "checkpoints",
    "clear_run",
    "fsync_dir",
    "holds_run",
    "read_metrics",
    "write_metrics",
]

METRICS, CHECKPOINTS, SAMPLE = "metrics.jsonl", "checkpoints", "sample.txt"


def checkpoints(out: Path) -> list[Path]:
    """Checkpoints in ``out`` (``step_*.pt`` files and ``step_*`` folders), oldest first."""
    found = []
    for p in (out / CHECKPOINTS).glob("step_*"):
        name = re.fullmatch(r"step_(\d+)(\.pt)?", p.name)
        if name and (p.is_file() if name[2] else p.is_dir()):
            found.append((int(name[1]), p))
    return [p for _, p in sorted(found)]


def holds_run(out: Path) -> list[str]:
    """What of a run ``out`` holds (``["metrics.jsonl", "2 checkpoints"]``); empty when it holds none."""
    found = [name for name in (METRICS, SAMPLE) if (out / name).exists()]
    n, folder = len(checkpoints(out)), out / CHECKPOINTS
    if n:
        found.append(f"{n} checkpoint{'s' * (n != 1)}")
    elif folder.is_dir() and any(folder.iterdir()):
        found.append("an unfinished checkpoint")  # a step_*.tmp left by a run killed mid-write
    return found


def check_out(config: TrainConfig) -> None:
    """Refuse, before any work, a run that would mix its files with an earlier run's in ``--out``.

    Raises:
        ConfigError: ``--out`` holds a run and neither --resume nor --overwrite was given, or --resume was
            given and ``--out`` holds no checkpoint.
    """
    out = Path(config.out)
    found = holds_run(out)
    if config.resume and not checkpoints(out):
        fix = "start over with --overwrite instead" if found else "run without --resume to start"
        raise ConfigError(f"--resume: no checkpoint in {str(out / CHECKPOINTS)!r}; {fix}")
    if found and not (config.resume or config.overwrite):
        raise ConfigError(
            f"--out {str(out)!r} already holds a run ({', '.join(found)}); "
            "add --resume to continue it, or --overwrite to delete it and start over"
        )


def clear_run(out: Path) -> None:
    """Delete a run's metrics, checkpoints and sample from ``out`` (what ``--overwrite`` replaces)."""
    for name in (METRICS, SAMPLE):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """``write(file)`` into a temporary file beside ``path``, flushed to disk, then renamed over ``path``.

    A process killed at any point leaves either the old file or the new one, never a torn one: ``os.replace``
    is atomic within a file system, and the fsync before it keeps a power loss from renaming an empty file.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk; POSIX only, nothing elsewhere."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Note: [appending metrics] metrics.jsonl grows by one line per step, appended in one write: a crash can tear
# only that last line, never the lines before it, and ``read_metrics`` drops a torn last line. Rewriting the
# whole file atomically every step would keep it whole too, but costs O(steps) per step (quadratic over a
# long run). A resumed run rewrites the file once, atomically, from its checkpoint's metrics: that drops a torn
# line and the steps after the checkpoint, which the run does again.


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one step's metrics to ``path`` (Note: [appending metrics])."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` atomically with ``rows``, one per line (a resumed run, from its checkpoint)."""
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The steps in a ``metrics.jsonl``; a torn last line (a run killed mid-append) is dropped.

    Raises:
        ConfigError: a line other than the last is not JSON (the file was damaged, not torn).
    """
    whole, _, _torn = Path(path).read_text(encoding="utf-8").rpartition("\n")  # text after the last \n: torn
    rows = []
    for number, line in enumerate(whole.split("\n") if whole else [], start=1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise ConfigError(f"{str(path)!r} line {number} is not JSON ({e}); the file is damaged") from e
    return rows

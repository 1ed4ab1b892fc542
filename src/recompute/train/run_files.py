"""The files of a run in ``--out``: what is there, whether a new run may start, atomic writes, the metrics log.

A run writes ``metrics.jsonl`` (one JSON object per step, each with a CRC-32 of itself), ``checkpoints/`` and
``sample.txt``. A new run never mixes its files with an earlier run's: without ``--resume`` it starts only in
an ``--out`` that holds no run, or with ``--overwrite``, which deletes nothing until the new run's first
checkpoint is written (Note: [overwrite]).
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError
from recompute.core.files import atomic_write, check_folder, fsync_dir
from recompute.train.config import TrainConfig

__all__ = [
    "ASIDE",
    "CHECKPOINTS",
    "METRICS",
    "SAMPLE",
    "append_metrics",
    "atomic_write",
    "check_out",
    "checkpoints",
    "clear_run",
    "damaged_metrics",
    "drop_aside",
    "fsync_dir",
    "holds_run",
    "read_metrics",
    "restore_aside",
    "set_aside",
    "write_metrics",
]

METRICS, CHECKPOINTS, SAMPLE = "metrics.jsonl", "checkpoints", "sample.txt"
ASIDE = ".overwritten"
"""Where ``--overwrite`` moves the earlier run until the new run's first checkpoint is written."""
RUN_FILES = (METRICS, SAMPLE, CHECKPOINTS)


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
    if (out / ASIDE).exists():
        found.append(f"an earlier run set aside by an --overwrite that did not finish ({ASIDE})")
    return found


def check_out(config: TrainConfig) -> None:
    """Refuse, before any work, a run that would mix its files with an earlier run's in ``--out``, or an
    ``--out`` where no file can be written (``recompute.core.files.check_folder``).

    Raises:
        ConfigError: ``--out`` is empty, a file, or not writable; it holds a run and neither --resume nor
            --overwrite was given; or --resume was given and ``--out`` holds no checkpoint.
    """
    out = check_folder(config.out, "--out", "runs/train")
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
    """Delete a run's metrics, checkpoints and sample from ``out``."""
    for name in (METRICS, SAMPLE):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)


# Note: [overwrite] ``--overwrite`` must not lose the earlier run to a new one that fails: a bad option found
# late, a plan for another model, a crash in the first steps. So the earlier run's files are moved, not
# deleted, into ``--out/.overwritten`` just before the first step (every check has passed by then), and
# deleted only once the new run's first checkpoint is on disk (``drop_aside``). A run that fails before that
# puts them back (``restore_aside``); one killed before that leaves them in ``.overwritten``, which
# ``holds_run`` reports, and the next ``--overwrite`` keeps them there as the run to replace (the killed
# attempt's files, which have no checkpoint, are what it deletes).


def set_aside(out: Path) -> Path | None:
    """Move the run in ``out`` into ``out/.overwritten`` (Note: [overwrite]); returns that folder, or None when
    there was nothing to move."""
    aside = out / ASIDE
    if aside.exists():  # an earlier --overwrite was killed: its new files go, the run it replaced stays aside
        clear_run(out)
        return aside
    present = [name for name in RUN_FILES if (out / name).exists()]
    if not present:
        return None
    aside.mkdir()
    for name in present:
        (out / name).rename(aside / name)
    fsync_dir(out)
    return aside


def restore_aside(out: Path, aside: Path) -> None:
    """Put the run set aside back into ``out``, deleting what the failed new run wrote."""
    clear_run(out)
    for entry in aside.iterdir():
        entry.rename(out / entry.name)
    aside.rmdir()
    fsync_dir(out)


def drop_aside(aside: Path) -> None:
    """Delete the run set aside: the new run's first checkpoint is written."""
    shutil.rmtree(aside, ignore_errors=True)


# Note: [appending metrics] metrics.jsonl grows by one line per step, appended in one write: a crash can tear
# only that last line, never the lines before it, and ``read_metrics`` drops a torn last line. Rewriting the
# whole file atomically every step would keep it whole too, but costs O(steps) per step (quadratic over a
# long run). A resumed run rewrites the file once, atomically, from its checkpoint's metrics: that drops a torn
# line and the steps after the checkpoint, which the run does again. Each line carries the CRC-32 of its own
# JSON (keys sorted, without the checksum), so a changed figure is found, not carried on (``read_metrics``
# refuses it; a resume reports it, ``damaged_metrics``).

CRC = "crc32"
"""The key of a metrics line's checksum."""


def _crc(row: dict[str, Any]) -> str:
    body = {k: v for k, v in row.items() if k != CRC}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def _line(row: dict[str, Any]) -> str:
    return json.dumps({**row, CRC: _crc(row)}) + "\n"


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one step's metrics, with its checksum, to ``path`` (Note: [appending metrics])."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(_line(row))


def write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` atomically with ``rows``, one per line (a resumed run, from its checkpoint)."""
    atomic_write(path, "".join(_line(r) for r in rows))


def _check_line(line: str) -> tuple[dict[str, Any] | None, str]:
    """The row of one metrics line without its checksum, or None and why it is damaged."""
    try:
        row = json.loads(line)
    except ValueError as e:
        return None, f"is not JSON ({e})"
    if not isinstance(row, dict):
        return None, f"is a JSON {type(row).__name__}, not a step's metrics"
    if CRC in row and row[CRC] != _crc(row):  # a line without one was written before checksums
        return None, "does not match its CRC-32"
    row.pop(CRC, None)
    return row, ""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The steps in a ``metrics.jsonl``, checksums checked; a torn last line (a run killed mid-append) is dropped.

    Raises:
        ConfigError: a line other than the last is not JSON or does not match its checksum (the file was
            damaged, not torn).
    """
    whole, _, _torn = Path(path).read_text(encoding="utf-8").rpartition("\n")  # text after the last \n: torn
    rows = []
    for number, line in enumerate(whole.split("\n") if whole else [], start=1):
        row, why = _check_line(line)
        if row is None:
            raise ConfigError(f"{str(path)!r} line {number} {why}; the file is damaged")
        rows.append(row)
    return rows


def damaged_metrics(path: Path) -> list[str]:
    """One line per damaged line of ``path`` (``line 3 does not match its CRC-32``); empty when whole or absent."""
    try:
        whole = path.read_text(encoding="utf-8", errors="replace").rpartition("\n")[0]
    except OSError:
        return []
    found = []
    for number, line in enumerate(whole.split("\n") if whole else [], start=1):
        _, why = _check_line(line)
        if why:
            found.append(f"line {number} {why}")
    return found

"""The files a command reads and writes, checked before any work starts. Standard library only.

Reading: a path argument must name a regular file (not a folder, a FIFO, a device or a symlink loop) of at
most a stated size, checked with ``stat`` before the file is opened (opening a FIFO blocks until a writer
comes; ``/dev/zero`` never ends), and read no further than that size (a ``/proc`` file says it is empty).
JSON must be UTF-8, one object, and hold finite numbers only (Python's ``json`` reads ``NaN``, ``Infinity``
and ``1e999`` as floats that would flow into figures).

Writing: the target must be a file path whose folder exists and takes a new file: a probe file is created
there and removed before the work (a read-only folder, ``/proc``, a full disk fail here, not after minutes of
work); the result is written beside the target, flushed, and renamed over it (``atomic_write``), so a run
killed mid-write leaves the old file or the new one, never a torn one. A target that exists must be a regular
file: renaming over ``/dev/null`` would replace the device.

Every refusal is a ``ConfigError``: one line that names the option (``flag``), what came and what is expected.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from recompute.core.errors import ConfigError
from recompute.core.table import MiB, size

__all__ = [
    "MAX_JSON_BYTES",
    "atomic_write",
    "check_folder",
    "check_input_file",
    "check_writable",
    "config_named",
    "fsync_dir",
    "is_path",
    "read_capped",
    "read_json_file",
]

MAX_JSON_BYTES = 256 * MiB
"""The largest JSON file recompute reads (a profile of a 126-layer model with every kernel listed is a few MiB;
a config.json, a plan or a device profile a few KiB)."""

_KINDS = (
    (stat.S_ISREG, "a file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def is_path(text: str | Path) -> bool:
    """Whether anything is at ``text`` (a file, a folder, a device, a link, even a dangling one or a loop): the
    test for "the user named a path". Never raises: a name too long for the file system names nothing
    (``Path.exists`` raises ``OSError`` for it)."""
    return bool(str(text)) and os.path.lexists(text)


def config_named(path: str | Path) -> tuple[str, str]:
    """How results name the model of a config.json path or its folder, and where it came from: ``qwen05`` and
    ``qwen05/config.json`` for ``qwen05/`` or ``qwen05/config.json``; ``mixtral`` for ``mixtral.json``."""
    path = Path(path)
    origin = str(path / "config.json" if path.is_dir() else path)
    if path.is_dir() or path.name == "config.json":
        folder = path if path.is_dir() else path.parent
        return folder.resolve().name or path.stem, origin
    return path.stem, origin


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _stat(path: Path, flag: str, fix: str) -> os.stat_result | None:
    """``os.stat(path)`` (following links), ``None`` when nothing is there; a symlink loop or a path through
    a file is refused."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP (a symlink loop), ENOTDIR (a path through a file), EACCES
        raise ConfigError(f"{flag} {str(path)!r}: {e.strerror}; {fix}") from None


def check_input_file(path: str | Path, flag: str, *, max_bytes: int, fix: str = "") -> Path:
    """``path`` if it names a regular file of at most ``max_bytes``; only ``stat`` is used (nothing is opened).

    Raises:
        ConfigError: empty, missing, a folder, a FIFO, a device, a socket, a symlink loop, or too large.
    """
    fix = fix or "pass a regular file"
    if not str(path):
        raise ConfigError(f"{flag} is empty; {fix}")
    p = Path(path)
    st = _stat(p, flag, fix)
    if st is None:
        raise ConfigError(f"{flag} {str(p)!r} does not exist; {fix}")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{flag} {str(p)!r} is {_kind(st.st_mode)}, not a regular file; {fix}")
    if st.st_size > max_bytes:
        raise ConfigError(
            f"{flag} {str(p)!r} holds {size(st.st_size)}, more than the {size(max_bytes)} recompute reads; {fix}"
        )
    return p


def read_capped(path: str | Path, flag: str, *, max_bytes: int, fix: str = "") -> bytes:
    """The bytes of the regular file ``path``, checked first (``check_input_file``) and read no further than
    ``max_bytes`` (a file that grows, or a ``/proc`` file that says it is empty, is cut off there and refused).

    Raises:
        ConfigError: as ``check_input_file``, or the file cannot be read.
    """
    p = check_input_file(path, flag, max_bytes=max_bytes, fix=fix)
    fix = fix or "pass a regular file"
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced between the stat and the open
                raise ConfigError(f"{flag} {str(p)!r} is not a regular file; {fix}")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {flag} {str(p)!r}: {e.strerror}; {fix}") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{flag} {str(p)!r} holds more than the {size(max_bytes)} recompute reads; {fix}")
    return data


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_file(
    path: str | Path, flag: str, *, fix: str, what: str = "", max_bytes: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """The JSON object in ``path``: a regular file of at most ``max_bytes``, UTF-8, one object, every number
    finite (``NaN``, ``Infinity`` and out-of-range numbers are refused).

    Args:
        flag: the option that named the file (``--bench``), or its role where no option did.
        fix: how to make a good file, the end of every message.
        what: the file's role (``bench results``), said in the message when given.

    Raises:
        ConfigError: one line naming ``flag``, the path, what is wrong and ``fix``.
    """
    raw = read_capped(path, flag, max_bytes=max_bytes, fix=fix)
    name = f"{flag} {str(path)!r}" + (f" ({what})" if what else "")
    try:
        data = json.loads(raw.decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None
    except (ValueError, RecursionError) as e:  # NaN, 1e999, an integer of 5,000 digits, nesting too deep
        raise ConfigError(f"{name} is not valid JSON ({str(e) or type(e).__name__}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a JSON object, not a {type(data).__name__}; {fix}")
    return data


def _probe(folder: Path, flag: str, target: Path) -> None:
    """Create and remove a file in ``folder``: what writing the result there will need."""
    probe = folder / f".{target.name or 'recompute'}.{os.getpid()}.probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{flag} {str(target)!r}: cannot write in the folder {str(folder)!r} ({e.strerror}); "
            "give a path in a writable folder"
        ) from None


def check_writable(path: str | Path, flag: str, example: str = "out.json") -> Path:
    """``path`` if a file can be written there (atomically, by ``atomic_write``); checked before any work.

    Raises:
        ConfigError: empty, a folder, a device or FIFO, a symlink loop, a read-only file, a missing folder,
            or a folder where no file can be created (read-only, ``/proc``, full).
    """
    if not str(path):
        raise ConfigError(f"{flag} is empty; give a file path, e.g. {example}")
    out = Path(path)
    fix = f"give a file path, e.g. {example}"
    st = _stat(out, flag, fix)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag} {str(out)!r} is a folder; give a file path, e.g. {out / example}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{flag} {str(out)!r} is {_kind(st.st_mode)}, not a file; {fix}")
    if st is not None and not os.access(out, os.W_OK):
        raise ConfigError(f"{flag} {str(out)!r} is read-only; {fix}, or make it writable")
    parent = out.parent
    parent_st = _stat(parent, flag, fix)
    if parent_st is None or not stat.S_ISDIR(parent_st.st_mode):
        raise ConfigError(f"{flag} {str(out)!r}: the folder {str(parent)!r} does not exist; create it first")
    _probe(parent, flag, out)
    return out


def check_folder(path: str | Path, flag: str, example: str = "runs/out") -> Path:
    """``path`` if it is a folder files can be written in, or one that can be created (its nearest existing
    parent takes a new file); nothing is created. Checked before any work.

    Raises:
        ConfigError: empty, a file or device, a symlink loop, or a folder (or nearest parent) not writable.
    """
    if not str(path):
        raise ConfigError(f"{flag} is empty; give a folder, e.g. {example}")
    out = Path(path)
    fix = f"give a folder, e.g. {example}"
    here = out
    while True:
        st = _stat(here, flag, fix)
        if st is not None:
            break
        if here.parent == here:
            raise ConfigError(f"{flag} {str(out)!r}: no part of it exists; {fix}")
        here = here.parent
    if not stat.S_ISDIR(st.st_mode):
        what = "is" if here == out else f"lies under {str(here)!r}, which is"
        raise ConfigError(f"{flag} {str(out)!r} {what} {_kind(st.st_mode)}, not a folder; {fix}")
    _probe(here, flag, out)
    return out


def atomic_write(path: str | Path, content: str | bytes | Callable[[IO[bytes]], Any]) -> None:
    """Write ``content`` (text as UTF-8, bytes, or a function that writes into the file) into a temporary file
    beside ``path``, flush it to disk, and rename it over ``path``.

    A process killed at any point leaves either the old file or the new one, never a torn one: ``os.replace``
    is atomic within a file system, and the fsync before it keeps a power loss from renaming an empty file.

    Raises:
        ConfigError: the file cannot be written (the disk filled up since ``check_writable``, ...); the
            temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise ConfigError(f"cannot write {str(target)!r}: {e.strerror}; {target} is left as it was") from None
    finally:
        tmp.unlink(missing_ok=True)  # what a failed write left (after the rename nothing is there)
    fsync_dir(target.parent)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk; POSIX only, nothing elsewhere."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

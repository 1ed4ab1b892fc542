"""The PyTorch releases recompute supports, and the one-line refusal of any other (torch-free).

recompute builds on pieces of PyTorch whose private details change between releases (MemTracker's dispatch,
FlopCounterMode's attention formulas, DTensor's sharding propagation); ``recompute._compat`` bridges the
releases listed here, each verified by ``scripts/torch-matrix`` (docs/install.md has its table). Outside them
the CLI exits with code 2 and the library raises ``ConfigError`` before any work, instead of a traceback (or
a C++ abort) somewhere inside a step.

``RECOMPUTE_ANY_TORCH=1`` lets a user try another release anyway (a nightly, say); the checks of the private
members recompute uses still refuse in one line what that release lacks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from recompute.core.errors import ConfigError

__all__ = ["NEWEST", "OLDEST", "installed_torch", "require_supported_torch", "supported_range", "torch_release"]

OLDEST = (2, 6)
"""The oldest minor release verified (``scripts/torch-matrix``); pyproject.toml's floor says the same."""
NEWEST = (2, 13)
"""The newest minor release verified."""
ANY_TORCH = "RECOMPUTE_ANY_TORCH"
"""Environment variable: set to 1 to run on a release outside the range anyway."""


def supported_range() -> str:
    """``torch 2.6 to 2.13``: the range in words, for messages and docs."""
    return f"torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (``2.10.0+cu128``, ``2.14.0.dev20260101``); None if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def installed_torch() -> str | None:
    """The version of the torch that ``import torch`` would load, read without importing it (its ``version.py``;
    ``importlib.metadata``, a tenth of a second, only where that file says nothing); None if there is none."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        with contextlib.suppress(OSError):
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", Path(folder, "version.py").read_text(), re.M)
            if m:
                return m[1]
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def require_supported_torch(version: str | None) -> None:
    """Refuse a torch release outside ``OLDEST``..``NEWEST`` (``None``: no torch installed, nothing to check).

    Raises:
        ConfigError: one line naming the supported range, the installed version and the fix; not raised when
            the environment variable ``RECOMPUTE_ANY_TORCH`` is ``1``.
    """
    if version is None or os.environ.get(ANY_TORCH) == "1":
        return
    release = torch_release(version)
    if release is not None and OLDEST <= release <= NEWEST:
        return
    below = f"{NEWEST[0]}.{NEWEST[1] + 1}"
    raise ConfigError(
        f"recompute supports {supported_range()}, and this environment has torch {version}; install a supported "
        f"release (pip install 'torch>={OLDEST[0]}.{OLDEST[1]},<{below}') or set {ANY_TORCH}=1 to try this one anyway"
    )

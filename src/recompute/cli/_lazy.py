"""Loading the torch floor on demand, so that ``estimate``, ``plan`` and ``report`` start without torch.

Note: [the torch floor, loaded late] ``import torch`` takes seconds; the torch-free commands load a torch
library module (``recompute.trace``) only when an option asks for it (``plan --trace``, ``report --trace``),
as a function-local ``import torch`` would. These loads still run down a floor, and tests/test_layers.py
counts them as edges of the import graph.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["torch_floor"]

TORCH_FLOOR = ("recompute.trace",)
"""The modules the front end may load late."""


def torch_floor(module: str) -> ModuleType:
    """Import one of ``TORCH_FLOOR`` now."""
    if module not in TORCH_FLOOR:
        raise ValueError(f"{module!r} is not loaded late; import it at the top of the module")
    return importlib.import_module(module)

"""recompute: know what activation recomputation saves and costs, plan it, and apply it in one line.

The analytic model (``estimate``) imports no torch; everything that touches torch is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from recompute.core import __version__
from recompute.core.analytic import Estimate, estimate, estimate_policies
from recompute.core.errors import ConfigError
from recompute.core.policy import POLICIES, Policy
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

# Torch-using functions, imported on first access so that ``import recompute`` stays torch-free.
_LAZY = {"apply": "recompute.checkpointing", "verify": "recompute.check_gradients"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recompute' has no attribute {name!r}")


__all__ = [
    "POLICIES",
    "ConfigError",
    "Estimate",
    "ModelSpec",
    "Policy",
    "Workload",
    "__version__",
    "apply",
    "estimate",
    "estimate_policies",
    "verify",
]

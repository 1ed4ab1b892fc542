"""recompute: know what activation recomputation saves and costs, plan it, and apply it in one line.

The analytic model (``estimate``) imports no torch; everything that touches torch is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from recompute.analytic import Estimate, estimate, estimate_policies
from recompute.errors import ConfigError
from recompute.policy import POLICIES, Policy
from recompute.spec import ModelSpec
from recompute.workload import Workload

__version__ = "0.1.0"

# Torch-using functions, imported on first access so that ``import recompute`` stays torch-free.
_LAZY = {"apply": "recompute.checkpointing", "verify": "recompute.verification"}


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
    "apply",
    "estimate",
    "estimate_policies",
    "verify",
]

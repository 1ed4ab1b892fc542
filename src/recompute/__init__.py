"""recompute: know what activation recomputation saves and costs, plan it, and apply it in one line.

    import recompute
    recompute.estimate("llama3.1-8b", 4096, "block")           # memory and FLOPs of a step, no torch
    plan = recompute.plan("config.json", budget="24GiB", seq_len=4096, micro_batch=8)
    recompute.apply(model, plan)                               # in place; gradients unchanged

``import recompute`` imports no torch; the functions that need it (``apply``, ``verify``, ``profile`` and a
``plan`` that has to measure something) load it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from recompute.api import estimate, plan, profile
from recompute.core import __version__
from recompute.core.analytic import Estimate, estimate_policies
from recompute.core.errors import ConfigError
from recompute.core.plan import Plan
from recompute.core.policy import POLICIES, Policy
from recompute.core.profile import Profile
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

# Torch-using functions, imported on first access so that ``import recompute`` stays torch-free.
_LAZY = {"apply": "recompute.checkpointing", "verify": "recompute.check_gradients"}

__all__ = [
    "POLICIES",
    "ConfigError",
    "Estimate",
    "ModelSpec",
    "Plan",
    "Policy",
    "Profile",
    "Workload",
    "__version__",
    "apply",
    "estimate",
    "estimate_policies",
    "plan",
    "profile",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recompute' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names only (``dir(recompute)`` in a notebook)."""
    return sorted(__all__)

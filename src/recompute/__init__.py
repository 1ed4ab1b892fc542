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
from typing import TYPE_CHECKING, Any

from recompute.core import __version__

# Every name is imported on first access: ``import recompute`` (and the CLI, which imports the package) stays light,
# and torch is loaded only by the functions that need it.
_LAZY = {
    "estimate": "recompute.api",
    "plan": "recompute.api",
    "profile": "recompute.api",
    "Estimate": "recompute.core.analytic",
    "estimate_policies": "recompute.core.analytic",
    "ConfigError": "recompute.core.errors",
    "Plan": "recompute.core.plan",
    "POLICIES": "recompute.core.policy",
    "Policy": "recompute.core.policy",
    "Profile": "recompute.core.profile",
    "ModelSpec": "recompute.core.spec",
    "Workload": "recompute.core.workload",
    "apply": "recompute.checkpointing",
    "verify": "recompute.check_gradients",
}

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


if TYPE_CHECKING:
    from recompute.api import estimate, plan, profile
    from recompute.check_gradients import verify
    from recompute.checkpointing import apply
    from recompute.core.analytic import Estimate, estimate_policies
    from recompute.core.errors import ConfigError
    from recompute.core.plan import Plan
    from recompute.core.policy import POLICIES, Policy
    from recompute.core.profile import Profile
    from recompute.core.spec import ModelSpec
    from recompute.core.workload import Workload


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'recompute' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names only (``dir(recompute)`` in a notebook)."""
    return sorted(__all__)

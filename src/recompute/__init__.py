"""recompute: know what activation recomputation saves and costs, plan it, and apply it in one line.

The analytic model (``estimate``) imports no torch; everything that touches torch is imported on first use.
"""

from __future__ import annotations

from recompute.analytic import Estimate, estimate, estimate_policies
from recompute.errors import ConfigError
from recompute.policy import POLICIES, Policy
from recompute.spec import ModelSpec
from recompute.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "ConfigError",
    "Estimate",
    "ModelSpec",
    "Policy",
    "Workload",
    "estimate",
    "estimate_policies",
]

"""The torch-free floor: model specs, workloads, policies, the analytic model, the planner, units, results.

Nothing here imports torch or any other floor of recompute; ``recompute estimate`` and ``recompute plan``
run on it alone.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"

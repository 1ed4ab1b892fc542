"""``recompute train`` and ``recompute compare-train``: the seed blog's GPT-2 experiment as commands.

``TrainConfig`` imports no torch (the CLI builds its options from it); the rest loads torch on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from recompute.train.config import TrainConfig

__all__ = [
    "CompareRow",
    "RunResult",
    "StepMetrics",
    "TrainConfig",
    "compare_train",
    "plot_losses",
    "read_metrics",
    "render_compare",
    "train",
]

_LAZY = {
    "CompareRow": "compare",
    "compare_train": "compare",
    "plot_losses": "compare",
    "render_compare": "compare",
    "RunResult": "loop",
    "StepMetrics": "loop",
    "train": "loop",
    "read_metrics": "run_files",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"recompute.train.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'recompute.train' has no attribute {name!r}")

"""When nothing fits: the smallest achievable peak, and the least invasive workload change that would fit.

The one message for every model source: ``alternatives`` prices a changed workload's smallest peak where that
is known without measuring (the analytic model re-reads a preset; a profile re-prices its model states), and
the first change that fits is named. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError
from recompute.core.table import GiB
from recompute.core.workload import Workload, build_workload

__all__ = ["ALTERNATIVE_FIELDS", "NothingFits", "alternatives_of", "nothing_fits"]

ALTERNATIVE_FIELDS = ("attention", "micro_batch", "precision", "dp", "tp", "sp")
"""The workload fields the advice changes (it names them)."""


class NothingFits(ConfigError):
    """No plan fits the budget: the message gives the smallest achievable peak and what would fit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, fields=ALTERNATIVE_FIELDS)


def nothing_fits(
    table: CostTable, budget: float, smallest: float, alternatives: Callable[[Workload], float | None] | None
) -> str:
    """The one "nothing fits" message: the smallest achievable peak, and the first, least invasive workload
    change whose smallest peak fits (``alternatives`` prices one; None where it cannot be known)."""
    wl = build_workload(**table.workload)
    fix = "; use a smaller micro-batch or sequence, or more GPUs"
    if alternatives is not None:
        for label, change in alternatives_of(wl):
            try:
                best = alternatives(change)
            except ConfigError:
                continue
            if best is not None and best <= budget:
                fix = f"; would fit: {label} ({best / GiB:.1f} GiB)"
                break
    return (
        f"no plan fits {budget / GiB:.1f} GiB: the smallest achievable peak of {table.model} at "
        f"b={wl.micro_batch} s={wl.seq_len} is {smallest / GiB:.1f} GiB{fix}"
    )


def alternatives_of(wl: Workload) -> list[tuple[str, Workload]]:
    """Changes that lower the peak, one at a time and then cumulatively, least invasive first."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if wl.attention == "eager":
        steps.append(("attention flash", {"attention": "flash"}))
    if wl.micro_batch > 1:
        steps.append((f"micro_batch {wl.micro_batch // 2}", {"micro_batch": wl.micro_batch // 2}))
    if wl.precision != "distributed":
        steps.append(("precision distributed dp 8", {"precision": "distributed", "dp": max(wl.dp, 8)}))
    t = wl.tp * 2
    if wl.seq_len % t == 0:
        steps.append((f"tp {t} sp", {"tp": t, "sp": True}))
    out = [(label, replace(wl, **change)) for label, change in steps]
    labels, merged = [], {}
    for label, change in steps:
        labels.append(label)
        merged.update(change)
        if len(labels) > 1:
            out.append((" ".join(labels), replace(wl, **merged)))
    return out

"""When nothing fits: the smallest achievable peak, whether the model states alone are the reason, and the
least invasive changes that would fit. Torch-free.

The one message for every model source (issue 35). First what no plan can change: when the rank's parameters,
gradients and optimizer state (``CostTable.states``) alone are over the budget, it says so, with their bytes
per parameter, since recomputation only lowers activations. Then the changes, least invasive first, each priced
by ``alternatives`` (the smallest achievable peak at the changed workload: the analytic model re-reads a preset,
a profile re-prices its states) where that is known without measuring: flash attention, a smaller micro-batch,
smaller states (Megatron's distributed optimizer for ``mixed``; ``bf16``: weights, gradients and AdamW in
bf16), FSDP's full shard over the fewest ranks that fit, tensor parallelism, and finally a GPU with the memory.
A change whose peak is not known without tracing again (one that switches autocast on or off: ``amp``) is
named with its model states alone, and the command that would price it. Those that fit are named (at most
three); where none fits, the smallest achievable peak stands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from recompute.core.analytic.params import bytes_per_param
from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError
from recompute.core.hardware import GPUS, usable_bytes
from recompute.core.table import GiB
from recompute.core.workload import Workload, build_workload

__all__ = ["ALTERNATIVE_FIELDS", "NothingFits", "alternatives_of", "nothing_fits"]

ALTERNATIVE_FIELDS = ("attention", "micro_batch", "precision", "dp", "fsdp", "tp", "sp")
"""The workload fields the advice changes (it names them)."""

FSDP_RANKS = (2, 4, 8, 16, 32, 64)
"""Data-parallel sizes the advice tries FSDP's full shard over, fewest first."""

SHOWN = 3
"""Changes that fit named at most."""


class NothingFits(ConfigError):
    """No plan fits the budget: the message gives the smallest achievable peak and what would fit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, fields=ALTERNATIVE_FIELDS)


def nothing_fits(
    table: CostTable, budget: float, smallest: float, alternatives: Callable[[Workload], float | None] | None
) -> str:
    """The one "nothing fits" message (module docstring): the smallest achievable peak, the model states when
    they alone are over ``budget``, and the least invasive changes whose smallest peak fits (``alternatives``
    prices one; None where it cannot be known)."""
    wl = build_workload(**table.workload)
    head = (
        f"no plan fits {_gib(budget)}: the smallest achievable peak of {table.model} at b={wl.micro_batch} "
        f"s={wl.seq_len} is {_gib(smallest)}"
    )
    states_over = table.states > budget
    if states_over:
        head += f"; {_states_phrase(table, wl)} alone are over the budget, which recomputation cannot lower"
    fits = _fitting(wl, table, budget, alternatives, states_over)
    gpu = _bigger_gpu(smallest, budget)
    if gpu:
        fits.append(gpu)
    if not fits:
        return head + "; use a smaller micro-batch or sequence, or more GPUs"
    return head + "; would fit: " + "; or ".join(fits[:SHOWN])


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _params(table: CostTable, wl: Workload) -> float:
    """The rank's parameter count, from its states' bytes and the precision's bytes per parameter."""
    per = sum(bytes_per_param(str(wl.precision), wl.dp, fsdp=wl.fsdp).values())
    return table.states / per if per else 0.0


def _states_phrase(table: CostTable, wl: Workload) -> str:
    per = sum(bytes_per_param(str(wl.precision), wl.dp, fsdp=wl.fsdp).values())
    return f"the model states ({_gib(table.states)}: {per:g} B per parameter under {wl.precision})"


def _fitting(
    wl: Workload,
    table: CostTable,
    budget: float,
    alternatives: Callable[[Workload], float | None] | None,
    states_over: bool,
) -> list[str]:
    """The changes (``alternatives_of``) that fit, in words, each with its smallest peak or, where that is not
    known, its model states and how to price it."""
    out: list[str] = []
    params = _params(table, wl)
    sharded = False  # FSDP named once: over the fewest ranks that fit
    for label, change, activations_only in alternatives_of(wl):
        if (states_over and activations_only) or (sharded and change.fsdp and not wl.fsdp):
            continue
        try:
            best = alternatives(change) if alternatives is not None else None
        except ConfigError:
            continue
        if best is not None:
            if best <= budget:
                out.append(f"{label} ({_gib(best)})")
                sharded = sharded or change.fsdp
            continue
        states = params * sum(bytes_per_param(str(change.precision), change.dp, fsdp=change.fsdp).values())
        if not activations_only and states <= budget and params:
            out.append(f"{label} (model states {_gib(states)}: plan with it for the peak)")
            sharded = sharded or change.fsdp
    return out


def alternatives_of(wl: Workload) -> list[tuple[str, Workload, bool]]:
    """Changes that lower the peak, least invasive first: (label, changed workload, whether only the
    activations change)."""
    out: list[tuple[str, Workload, bool]] = []
    if wl.attention == "eager":
        out.append(("--attention flash", replace(wl, attention="flash"), True))
    if wl.micro_batch > 1:
        out.append((f"--micro-batch {wl.micro_batch // 2}", replace(wl, micro_batch=wl.micro_batch // 2), True))
    if wl.precision == "mixed" and not wl.fsdp:  # Megatron's: its distributed optimizer first
        d = max(wl.dp, 8)
        out.append((f"--precision distributed --dp {d}", replace(wl, precision="distributed", dp=d), False))
    if wl.precision not in ("bf16", "distributed") and not wl.fsdp:
        out.append(("--precision bf16 (weights, gradients and AdamW in bf16)", _precision(wl, "bf16"), False))
    for d in FSDP_RANKS:
        if d > wl.dp:
            out.append(_fsdp(wl, d))
    t = wl.tp * 2
    if wl.seq_len % t == 0 and not wl.fsdp:
        out.append((f"--tp {t} --sp", replace(wl, tp=t, sp=True), False))
    return [(label, change, only) for label, change, only in out if _valid(change)]


def _precision(wl: Workload, precision: str) -> Workload:
    return replace(wl, precision=precision, dtype="bf16" if wl.dtype == "fp32" else wl.dtype)


def _fsdp(wl: Workload, d: int) -> tuple[str, Workload, bool]:
    """FSDP's full shard over d ranks at the workload's precision (ZeRO-1's ``distributed`` becomes ``mixed``)."""
    precision = "mixed" if wl.precision == "distributed" else wl.precision
    flags = f"--fsdp --dp {d}" + (" --precision mixed" if precision != wl.precision else "")
    return flags, replace(wl, fsdp=True, dp=d, precision=precision), False


def _valid(wl: Workload) -> bool:
    try:
        build_workload(**wl.to_dict())
    except ConfigError:
        return False
    return True


def _bigger_gpu(smallest: float, budget: float) -> str | None:
    """The GPU with the least memory whose usable memory holds ``smallest``, if it has more than ``budget``."""
    rows: Sequence[Any] = sorted(GPUS.values(), key=lambda g: g.memory)
    for gpu in rows:
        usable = usable_bytes(gpu)
        if usable >= smallest and usable > budget and math.isfinite(smallest):
            return f"one {gpu.label} ({_gib(usable)} usable)"
    return None

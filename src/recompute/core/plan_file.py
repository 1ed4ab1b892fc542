"""``Plan``: what the planner returns (the chosen plan, its prediction, the frontier), and the plan file it writes.

A plan file is JSON: ``Policy.from_dict`` reads its ``policy`` entry (so ``apply`` takes the file as is) and
``apply`` its loss mode (``read_plan``); ``model`` names the model by its identity (``recompute.core.identity``:
``{"name": ..., "hash": ...}``), which ``apply`` checks; the rest is the prediction, the frontier and the
uniform policies for comparison, and where the figures come from. Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require
from recompute.core.files import atomic_write
from recompute.core.hardware import GPUS, gpu_by_name, usable_bytes
from recompute.core.identity import ModelId
from recompute.core.plan_schema import check_plan_dict
from recompute.core.policy import Policy
from recompute.core.results import read_json
from recompute.core.table import GiB, MiB, gib

__all__ = ["FORMAT", "Plan", "PlanPoint", "Traced", "check_plan_dict", "parse_budget", "plan_loss", "read_plan"]

FORMAT = "recompute.plan/2"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}


def parse_budget(text: str | float, what: str = "budget", *, replayed: bool = False) -> float:
    """Bytes from ``70GiB``, ``80 GB``, ``7.5e10``, a number, or a GPU name (``h100-80gb``: its usable memory).

    ``replayed``: the plan is checked by what the caching allocator reserves (``Traced.reserved``), so a GPU's
    usable memory leaves out the fragmentation allowance, which that replay measures.

    Raises:
        ConfigError: neither a positive size nor a known GPU (``what``: the field it is for).
    """
    if isinstance(text, str) and text.strip().lower() in GPUS:
        gpu = gpu_by_name(text.strip().lower())
        return float(usable_bytes(gpu, fragmentation=0.0) if replayed else usable_bytes(gpu))
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        require(
            m is not None and unit in _UNITS,
            f"{what} {text!r} is not a size or a GPU; write e.g. 70GiB, 80GB or a GPU name ({', '.join(GPUS)})",
            fields=(what,),
        )
        value = float(m.group(1)) * _UNITS[unit]  # type: ignore[union-attr]
    require(0 < value < float("inf"), f"{what} must be a positive, finite size, got {text!r}", fields=(what,))
    return value


@dataclass(frozen=True)
class Traced:
    """A plan's step as traced: its peak, and on CUDA what the caching allocator reserves over its steps."""

    peak: float
    reserved: float | None = None

    @property
    def needs(self) -> float:
        """The bytes the step needs of the device: what the allocator reserves where it is known."""
        return self.reserved if self.reserved is not None else self.peak


@dataclass(frozen=True)
class PlanPoint:
    """One plan on the frontier: nothing else is both cheaper and smaller."""

    peak: float
    """Predicted peak bytes per rank."""
    cost: float
    """What recomputation (and offload, and the loss mode) adds to the step: FLOPs, or seconds when priced."""
    overhead: float
    """``cost`` over the step's cost without recomputation, in the workload's own loss mode."""
    layers: tuple[str, ...]
    """The option of each layer of the first pipeline stage (repeated on every stage)."""
    loss: str = "full"
    """The loss mode the point is planned with (``Workload.loss``)."""
    flops: float = 0.0
    """FLOPs replayed in the step."""
    step_seconds: float | None = None
    """The step's predicted seconds, when priced in time."""
    host: float = 0.0
    """Host bytes of the offloaded layers."""


@dataclass(frozen=True)
class Plan:
    """The chosen plan with its prediction, the frontier and the uniform policies for comparison."""

    model: str
    """The model's name (``identity`` adds its hash)."""
    workload: dict[str, Any]
    """The workload planned, in the chosen loss mode."""
    budget: float
    layers: tuple[str, ...]
    """The option of every layer of the model."""
    chosen: PlanPoint
    peak_phase: str
    held: float
    """Bytes the first stage's layers hold for the backward (one micro-batch): absolute from the analytic model's
    table; from a profile's, relative to ``none`` (its base phases hold none's), so negative where the plan
    recomputes (``Profile.cost_table``; issue 36's ``held=-30009985024.0``)."""
    kept: tuple[float, ...]
    """Bytes each layer of the first stage saves for the backward under its option."""
    cost_kind: str
    model_cost: float
    """The step's cost without recomputation, in the unit of ``cost``, in the workload's own loss mode."""
    model_flops: float
    tokens: int
    frontier: tuple[PlanPoint, ...]
    uniform: dict[str, PlanPoint] = field(default_factory=dict)
    host_budget: float | None = None
    traced_peak: float | None = None
    """The chosen plan's peak by ``recompute.trace`` (``plan(..., traced_peak=...)``), else ``None``."""
    traced_reserved: float | None = None
    """What the CUDA caching allocator reserves at most over the chosen plan's steps, replayed from its trace
    (``Traced.reserved``; what the budget was checked against), else ``None``."""
    device: dict[str, Any] | None = None
    source: str = ""
    notes: tuple[str, ...] = ()
    model_hash: str = ""
    """The hash of the model's architecture (``recompute.core.identity``); empty where it is not known."""
    memory_budget: float | None = None
    """``torch._functorch.config.activation_memory_budget`` the plan runs under (``recompute.compile_plan``);
    None: PyTorch's (or an eager plan)."""
    compiled: dict[str, Any] | None = None
    """The compiled step's options the plan was chosen among (``CompiledPlan.to_dict``), where it was weighed
    under ``torch.compile``."""

    def __repr__(self) -> str:
        """One line (the whole plan, frontier and all, is ``to_dict()``: its repr ran to 94,319 characters)."""
        w = self.workload
        return (
            f"Plan({self.model!r}, b={w.get('micro_batch')} s={w.get('seq_len')}: {self.policy.describe()}"
            f"{', chunked loss' if self.loss == 'chunked' else ''}{self._budget_said()}, "
            f"peak {gib(self.peak)} of {gib(self.budget)}, "
            f"+{100 * self.overhead:.1f}% {'time' if self.timed else 'FLOPs'}; {len(self.frontier)} frontier points)"
        )

    def _budget_said(self) -> str:
        return f", compile budget {self.memory_budget:g}" if self.memory_budget is not None else ""

    @property
    def identity(self) -> ModelId:
        """The model the plan is for: what ``apply`` checks the model against."""
        return ModelId(self.model, self.model_hash)

    @property
    def peak(self) -> float:
        return self.chosen.peak

    @property
    def cost(self) -> float:
        return self.chosen.cost

    @property
    def overhead(self) -> float:
        return self.chosen.overhead

    @property
    def loss(self) -> str:
        return self.chosen.loss

    @property
    def host(self) -> float:
        return self.chosen.host

    @property
    def recompute_flops(self) -> float:
        return self.chosen.flops

    @property
    def timed(self) -> bool:
        """Costs are seconds (predicted or measured): a point's step time is known."""
        return self.chosen.step_seconds is not None

    @property
    def policy(self) -> Policy:
        """The plan as a policy ``apply`` takes."""
        return Policy(layers=self.layers, model=self.identity, memory_budget=self.memory_budget)

    @property
    def loss_chunk(self) -> int | None:
        return self.workload.get("loss_chunk")

    def save(self, path: str | Path) -> None:
        """Write the plan file (``recompute.apply(model, path)`` takes it as it is)."""
        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The plan file: ``Policy.from_dict`` reads its ``policy`` entry, ``apply`` its loss mode."""

        def point(p: PlanPoint) -> dict[str, Any]:
            out = {"peak": p.peak, "cost": p.cost, "overhead": p.overhead, "layers": list(p.layers), "loss": p.loss}
            out |= {"recompute_flops": p.flops, "flop_overhead": p.flops / self.model_flops, "host": p.host}
            if p.step_seconds is not None:
                out |= {"step_seconds": p.step_seconds, "tokens_per_second": self.tokens / p.step_seconds}
            return out

        return {
            "format": FORMAT,
            "model": self.identity.to_dict(),
            "source": self.source,
            "workload": self.workload,
            "budget": self.budget,
            "host_budget": self.host_budget,
            "cost_kind": self.cost_kind,
            "device": self.device,
            "policy": self.policy.to_dict(),
            "loss": {"mode": self.loss, "chunk": self.loss_chunk},
            "predicted": {
                **point(self.chosen),
                "peak_phase": self.peak_phase,
                "held": self.held,
                "kept": list(self.kept),
                "model_cost": self.model_cost,
                "traced_peak": self.traced_peak,
                "traced_reserved": self.traced_reserved,
            },
            "frontier": [point(p) for p in self.frontier],
            "uniform": {name: point(p) for name, p in self.uniform.items()},
            "notes": list(self.notes),
            **({"compiled": self.compiled} if self.compiled is not None else {}),
        }


def plan_loss(data: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """The loss mode and chunk a plan file records: its ``loss`` entry, else its workload's (plans written
    before the entry); None for a policy file, which says nothing of the loss."""
    loss = data.get("loss")
    if isinstance(loss, Mapping) and isinstance(loss.get("mode"), str):
        return loss["mode"], loss.get("chunk")
    wl = data.get("workload")
    if isinstance(wl, Mapping) and isinstance(wl.get("loss"), str):
        return wl["loss"], wl.get("loss_chunk")
    return None


def read_plan(path: str | Path) -> tuple[Policy, tuple[str, int | None] | None]:
    """A policy or plan file: its policy (with the model it was made for) and the loss mode and chunk a plan
    records (``plan_loss``).

    Raises:
        ConfigError: unreadable, or not a policy or plan (``check_plan_dict``).
    """
    data = read_json(path, "policy file", "pass a policy name or a file written by `recompute plan -o`")
    try:
        check_plan_dict(data)
    except ConfigError as e:
        raise ConfigError(f"plan file {str(path)!r}: {e}") from None
    return Policy.load(path), plan_loss(data)

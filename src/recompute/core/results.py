"""Result records that outlive a run: what ``recompute bench`` writes, and the one reader of it.

``bench`` (one process) and ``bench_parallel`` (torchrun) return these records; ``--json`` writes their
``to_dict()``; ``read_bench`` reads either back for ``plan --cost measured`` and ``report --bench``, and
refuses a file made for another model. Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require

__all__ = ["BenchResult", "BenchRow", "ParallelBench", "RankRow", "read_bench", "read_json"]

BENCH_FIX = "pass a file written by `recompute bench --json`"


@dataclass(frozen=True)
class BenchRow:
    """One policy's measured step."""

    policy: str
    peak: int
    """Peak bytes of the step: MemTracker on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU."""
    traced_peak: int
    """Peak bytes MemTracker saw (equal to ``peak`` on the CPU)."""
    activations: int
    """Bytes saved for the backward (layers, embedding, head and loss)."""
    step_s: float
    """Median step time (forward + backward + optimizer step), seconds."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    tokens_per_s: float
    predicted_overhead: float
    """Analytic recompute overhead: recomputed FLOPs / model FLOPs of the step."""
    predicted_peak: float
    """Analytic peak (``recompute estimate``) for the same workload."""
    step_times: tuple[float, ...] = ()
    """Every timed step's seconds, in order (their spread is the machine's noise)."""
    predicted_step_s: float | None = None
    """The time model's step time (``recompute.core.timing``) on the device profile bench was given."""
    predicted_time_overhead: float | None = None
    """The time model's overhead: predicted step time over the predicted step without recomputation."""
    loss: str = "full"
    """The loss mode the step ran with (``bench --loss-modes full,chunked`` runs each policy under both)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRow:
        known = {f.name for f in dataclasses.fields(cls)}
        row = {k: v for k, v in data.items() if k in known}
        return cls(**{**row, "step_times": tuple(row.get("step_times", ()))})


@dataclass(frozen=True)
class BenchResult:
    """All policies of one benchmark; the first policy is the reference for the relative columns."""

    model: str
    spec: dict[str, Any]
    workload: dict[str, Any]
    steps: int
    warmup: int
    device: str
    rows: tuple[BenchRow, ...]
    notes: tuple[str, ...] = ()
    """The first names the class built and its source; then where the predicted columns come from."""

    @property
    def reference(self) -> BenchRow:
        return self.rows[0]

    def overhead(self, row: BenchRow) -> float:
        """Measured step-time increase over the reference policy."""
        return row.step_s / self.reference.step_s - 1

    def peak_drop(self, row: BenchRow) -> float:
        """Measured peak-memory drop from the reference policy."""
        return 1 - row.peak / self.reference.peak

    def step_times(self) -> dict[str, float]:
        """Median step seconds by policy, under the workload's loss mode."""
        loss = self.workload.get("loss", "full")
        return {r.policy: r.step_s for r in self.rows if r.loss == loss}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [dict(asdict(r), overhead=self.overhead(r), peak_drop=self.peak_drop(r)) for r in self.rows]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        rows = tuple(BenchRow.from_dict(r) for r in data["rows"])
        given = {k: data[k] for k in ("model", "spec", "workload", "steps", "warmup", "device")}
        return cls(**given, rows=rows, notes=tuple(data.get("notes", ())))


@dataclass(frozen=True)
class RankRow:
    """One policy under one parallel setting, on one rank."""

    mode: str
    """``TP`` or ``TP+SP`` (``DP`` when t = 1)."""
    policy: str
    measured: float
    """Activation bytes one layer keeps on this rank (mean over the layers)."""
    analytic: float
    """``layer_activations(spec, wl).stored(policy)`` for this step."""
    paper_setting: float
    """The analytic model in the paper's accounting (fp16, 1-byte dropout masks)."""
    paper: float | None
    """Korthikanti et al. 2022 Table 2 (``paper_layer_bytes``), where the paper covers the model and policy."""
    step_s: float
    """Median training step (forward, backward, AdamW step)."""
    peak: int | None
    """``torch.cuda.max_memory_allocated`` over one step on this rank (CUDA only)."""
    predicted_s: float | None = None
    """The time model's step for this rank (``recompute.core.pricing.step_time``: kernels and collectives)."""


@dataclass(frozen=True)
class ParallelBench:
    """``bench_parallel``'s result, as rank 0 sees it."""

    model: str
    workload: dict[str, Any]
    world: int
    device: str
    steps: int
    rows: tuple[RankRow, ...]
    notes: tuple[str, ...] = ()
    """Where the predicted times come from (the device profile, its collectives)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelBench:
        rows = tuple(RankRow(**r) for r in data["rows"])
        keys = ("model", "workload", "world", "device", "steps")
        return cls(**{**{k: data[k] for k in keys}, "rows": rows, "notes": tuple(data.get("notes", ()))})


def read_json(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, or holds no object; ``what`` names the file's
            role and ``fix`` says how to make a good one.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {e.strerror}; {fix}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}); {fix}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a JSON object, not a {type(data).__name__}; {fix}")
    return data


def read_bench(path: str | Path, *, model: str | None = None) -> BenchResult:
    """The one-process ``recompute bench --json`` result in ``path``.

    Args:
        model: refuse results of any other model (the name ``bench`` recorded).

    Raises:
        ConfigError: unreadable, not a bench result, or (with ``model``) a result for another model.
    """
    data = read_json(path, "bench results", BENCH_FIX)
    try:
        result = BenchResult.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"bench results {str(path)!r} are not a bench result (missing {e}); {BENCH_FIX}") from e
    require(len(result.rows) > 0, f"bench results {str(path)!r} hold no rows; {BENCH_FIX}")
    if model is not None:
        require(
            result.model == model,
            f"bench results {str(path)!r} are for model {result.model!r}, not {model!r}; "
            f"pass --model {result.model} or bench --model {model}",
        )
    return result

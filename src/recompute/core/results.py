"""Result records that outlive a run: what ``recompute bench`` writes, and the one reader of it.

``bench`` (one process) and ``bench_parallel`` (torchrun) return these records; ``--json`` writes their
``to_dict()``; ``read_bench`` reads either back for ``plan --cost measured`` and ``report --bench``, and
refuses a file made for another model. Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require
from recompute.core.files import read_json_file

__all__ = ["BENCH_FORMAT", "BenchResult", "BenchRow", "ParallelBench", "RankRow", "read_bench", "read_json"]

BENCH_FIX = "pass a file written by `recompute bench --json`"
BENCH_FORMAT = "recompute.bench/1"
"""``recompute bench --json``'s shape (docs/json.md); results written before it carry no format."""


@dataclass(frozen=True)
class BenchRow:
    """One policy's measured step."""

    policy: str
    peak: int
    """Peak bytes of the step: MemTracker on the CPU (c10's allocator for a compiled step),
    ``torch.cuda.max_memory_allocated`` on a GPU (with the model and its optimizer state held between steps)."""
    traced_peak: int
    """Peak bytes MemTracker saw (equal to ``peak`` on the CPU; 0 for a compiled step, whose buffers it does not
    see)."""
    activations: int
    """Bytes saved for the backward (layers, embedding, head and loss; a compiled step's: its compiled regions')."""
    step_s: float
    """Median step time (forward + backward + optimizer step), seconds."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    tokens_per_s: float
    predicted_overhead: float
    """Analytic recompute overhead: recomputed FLOPs / model FLOPs of the step (a compiled step's: its partitioned
    graphs' FLOPs over the first row's)."""
    predicted_peak: float
    """The peak of the same step's fake-tensor trace (``recompute trace``): the step bench runs, in its precision
    (a compiled step's: ``recompute trace --compiled``'s, above what the step holds between steps)."""
    step_times: tuple[float, ...] = ()
    """Every timed step's seconds, in order (their spread is the machine's noise)."""
    predicted_step_s: float | None = None
    """The time model's step time (``recompute.core.timing``) on the device profile bench was given."""
    predicted_time_overhead: float | None = None
    """The time model's overhead: predicted step time over the predicted step without recomputation."""
    loss: str = "full"
    """The loss mode the step ran with (``bench --loss-modes full,chunked`` runs each policy under both)."""
    reserved: int | None = None
    """``torch.cuda.max_memory_reserved`` over the policy's steps, the cache emptied after its model was built (what
    PyTorch's caching allocator took from the GPU); ``None`` off CUDA."""
    predicted_reserved: float | None = None
    """What the trace's replay of the caching allocator predicts for ``reserved`` (``TraceResult.reserved``)."""
    analytic_peak: float | None = None
    """A preset's analytic peak (``recompute estimate``) for the same step; ``None`` for another source."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRow:
        """Inverse of ``asdict``; every figure checked to be a number in its range (a measured time above 0).

        Raises:
            ConfigError: a figure that is missing, not a number, negative, or a zero step time.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        row = {k: v for k, v in data.items() if k in known}
        name = row.get("policy")
        if not isinstance(name, str):
            raise ConfigError(f"a row's policy must be a string, got {name!r}")
        for key in _ROW_FIGURES:
            _figure(f"{name}: {key}", row.get(key), strict=key == "step_s")
        _figure(f"{name}: predicted_overhead", row.get("predicted_overhead"), low=-math.inf)
        for key in ("predicted_step_s", "predicted_time_overhead"):
            if row.get(key) is not None:
                _figure(f"{name}: {key}", row[key], low=-math.inf)
        for key in ("reserved", "predicted_reserved", "analytic_peak"):
            if row.get(key) is not None:
                _figure(f"{name}: {key}", row[key])
        times = row.get("step_times", ())
        if not isinstance(times, list | tuple):
            raise ConfigError(f"{name}: step_times must be a list of seconds, got {times!r}")
        for t in times:
            _figure(f"{name}: step_times", t)
        return cls(**{**row, "step_times": tuple(times)})


_ROW_FIGURES: tuple[str, ...] = ("peak", "traced_peak", "activations", "step_s", "forward_s", "backward_s")
_ROW_FIGURES += ("optimizer_s", "tokens_per_s", "predicted_peak")


def _figure(name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> None:
    """Refuse a figure that is not a finite number at least ``low`` (above it when ``strict``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"{'above' if strict else 'at least'} {low:g}" if math.isfinite(low) else "finite"
        raise ConfigError(f"{name} must be a number {bound}, got {value!r}")


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
    """The first names the class built and its source; then the precision run, where the predicted columns come
    from and how the runs were laid out in time."""
    drift: float | None = None
    """The reference's median step when it ran again after every other run, over its first run's, minus one: how
    far the machine's speed drifted over the benchmark (``None``: one run, or a result from before it was kept)."""
    compiled: str | None = None
    """``model`` or ``block``: the steps ran ``torch.compile``d (``bench --compiled``); None: eager."""
    memory_budget: float | None = None
    """The compiled steps' ``activation_memory_budget`` (None: PyTorch's own)."""

    @property
    def reference(self) -> BenchRow:
        return self.rows[0]

    def __repr__(self) -> str:
        """One line per policy's headline figures; everything is ``to_dict()``'s."""
        rows = "; ".join(f"{r.policy} {r.peak / 2**30:.2f} GiB {1e3 * r.step_s:.0f} ms" for r in self.rows)
        return f"BenchResult({self.model!r} on {self.device}: {rows})"

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
        drift = data.get("drift")
        if drift is not None:
            _figure("drift", drift, low=-1.0)
        compiled, budget = data.get("compiled"), data.get("memory_budget")
        require(compiled in (None, "model", "block"), f"compiled must be null, 'model' or 'block', got {compiled!r}")
        if budget is not None:
            _figure("memory_budget", budget, strict=True)
            require(budget <= 1 and compiled is not None, f"memory_budget {budget} needs compiled steps and <= 1")
        return cls(
            **given, rows=rows, notes=tuple(data.get("notes", ())), drift=drift, compiled=compiled, memory_budget=budget
        )


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
    """The JSON object in ``path`` (``recompute.core.files.read_json_file``: a regular file of sane size, UTF-8,
    finite numbers).

    Raises:
        ConfigError: the file is missing, not a regular file, too large, unreadable, not UTF-8 JSON, holds a
            non-finite number, or holds no object; ``what`` names the file's role and ``fix`` says how to make
            a good one.
    """
    return read_json_file(path, what, fix=fix)


def read_bench(path: str | Path, *, model: str | None = None) -> BenchResult:
    """The one-process ``recompute bench --json`` result in ``path``.

    Args:
        model: refuse results of any other model (the name ``bench`` recorded).

    Raises:
        ConfigError: unreadable, not a bench result, or (with ``model``) a result for another model.
    """
    data = read_json(path, "bench results", BENCH_FIX)
    found = data.get("format", BENCH_FORMAT)
    require(found == BENCH_FORMAT, f"bench results {str(path)!r} are {found!r}, not {BENCH_FORMAT}; {BENCH_FIX}")
    try:
        result = BenchResult.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"bench results {str(path)!r}: {e}; {BENCH_FIX}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"bench results {str(path)!r} are not a bench result (missing {e}); {BENCH_FIX}") from e
    require(len(result.rows) > 0, f"bench results {str(path)!r} hold no rows; {BENCH_FIX}")
    if model is not None:
        require(
            result.model == model,
            f"bench results {str(path)!r} are for model {result.model!r}, not {model!r}; "
            f"pass --model {result.model} or bench --model {model}",
        )
    return result

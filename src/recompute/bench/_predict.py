"""What ``bench`` predicts for the steps it runs, and whether this machine can take them, before anything is built.

The step bench runs is plain training in one dtype (``run_precision``): parameters, gradients and AdamW's state
all in ``wl.dtype``. Every figure a row is measured against is of that step: its peak from the step's fake-tensor
trace (``recompute trace``) and, on CUDA, what the caching allocator reserves over its steps (the trace's replay);
for a preset also the analytic model's peak and its recompute overhead (``recompute estimate``).

Runs go one after another with one model and optimizer alive (``recompute.bench._single``), so they fit when the
largest one does: on a GPU the memory check decides; on the CPU a run must also end in reasonable time
(``require_time``: its FLOPs at this CPU's matmul rate, measured on the spot).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recompute.core.analytic import Estimate, estimate
from recompute.core.analytic.params import bytes_per_param
from recompute.core.errors import ConfigError
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.core.states import traced_precision
from recompute.core.workload import AMP, Workload
from recompute.models.source import ModelSource
from recompute.runtime import HEADROOM, TORCH_DTYPES, available_memory, require_memory, sync
from recompute.trace import CompiledTrace, TraceResult, trace, trace_compiled

__all__ = [
    "MAX_MINUTES",
    "SIZE_FIELDS",
    "Predicted",
    "as_run",
    "compiled_peak",
    "matmul_rate",
    "precision_note",
    "predict",
    "predicted_need",
    "require_time",
    "run_precision",
    "traced_need",
]

MAX_MINUTES = 30.0
"""The longest CPU bench run (predicted) that starts without being asked for (``max_minutes``)."""

SIZE_FIELDS = ("seq_len", "micro_batch", "n_layers", "hidden", "vocab")
"""The fields the memory advice names."""

Runs = Sequence[tuple[Workload, Policy]]
"""Each run's workload (its loss mode) and policy, in the order they run."""


def run_precision(wl: Workload) -> str:
    """The precision mode bench runs ``wl`` in: the one it can run as asked, else the plain one-dtype step.

    bench builds its model in ``wl.dtype`` and steps a plain AdamW over it: the ``fp32`` mode (4 + 4 + 8 B per
    parameter) or, in bf16 or fp16, the ``bf16`` mode (2 + 2 + 4 B); under ``amp`` it runs autocast over fp32
    weights, as asked. A workload asking for ``mixed`` or ``distributed`` (fp32 master weights, a sharded
    optimizer) runs, and is priced, as the plain one-dtype step.
    """
    return traced_precision(wl.dtype, wl.precision)


def as_run(wl: Workload) -> Workload:
    """``wl`` with the precision bench runs it in (``run_precision``): what every prediction prices."""
    return dataclasses.replace(wl, precision=run_precision(wl))


def precision_note(wl: Workload) -> str:
    """One line: the precision bench ran and priced, and what became of the one ``wl`` asked for if it differs."""
    ran = run_precision(wl)
    line = f"ran and priced {ran} precision: {_per_param(ran)} in {wl.dtype}"
    if wl.precision is not None and wl.precision != ran:
        line += f"; the workload asked for {wl.precision} ({_per_param(wl.precision)}), priced as the step bench runs"
    return line


def _per_param(precision: str) -> str:
    return f"{sum(bytes_per_param(precision).values()):g} B per parameter"


@dataclass(frozen=True)
class Predicted:
    """The figures each run's row is measured against, in run order."""

    traces: tuple[TraceResult, ...]
    """The fake-tensor trace of each run's step: the predicted peak (and, on CUDA, reserve)."""
    analytic: tuple[Estimate, ...] | None
    """A preset's analytic estimate of each run's step (its overhead and peak); ``None`` for another source."""
    why: str = "the analytic model describes recompute's reference GPT-2 and Llama, not this class"
    """Why there is no analytic estimate, when there is none."""
    compiled: tuple[CompiledTrace, ...] | None = None
    """The compiled step's trace of each run (``bench --compiled``), its peak traced too."""

    @property
    def peaks(self) -> tuple[float, ...]:
        if self.compiled is None:
            return tuple(float(t.peak) for t in self.traces)
        return tuple(float(compiled_peak(t, c)) for t, c in zip(self.traces, self.compiled))

    @property
    def note(self) -> str:
        """Where the predicted columns come from."""
        if self.compiled is not None:
            return (
                "predicted peak: the compiled step traced on fake tensors (recompute trace --compiled, Inductor's "
                "buffers modelled) above what the step holds between steps, or the eager trace's optimizer step if "
                "higher; predicted overhead: the FLOPs of the partitioned graphs over the first run's (per block: the "
                "layers' graphs alone); measured peak: c10's CPU allocator (or CUDA's), saved bytes: the compiled "
                "regions' autograd nodes (per block: the layers', not the eager head's)"
            )
        peak = "predicted peak: the fake-tensor trace of the same step (recompute trace)"
        if self.analytic is not None:
            return f"{peak}; predicted overhead and analytic peak: the preset's analytic model (recompute estimate)"
        return (
            f"{peak}; predicted overhead: its FLOPs counted (FlopCounterMode) in a forward and backward over the "
            f"first policy's; {self.why}"
        )


def compiled_peak(eager: TraceResult, compiled: CompiledTrace) -> int:
    """The compiled step's predicted peak: its forward and backward's (``CompiledTrace.peak``) above what the step
    holds between steps (parameters, AdamW's state, buffers and the batch, as the eager trace has them), or the
    optimizer step's, which runs eagerly, where that is higher."""
    assert compiled.peak is not None
    held = eager.parameters + eager.optimizer + eager.other
    return max(held + compiled.peak, eager.phases.get("optimizer step", 0))


def predict(
    source: ModelSource,
    runs: Runs,
    device: str,
    *,
    steps: Sequence[int],
    max_minutes: float,
    compiled: str | None = None,
    budget: float | None = None,
) -> Predicted:
    """Refuse runs this machine cannot take, before building anything; then each run's predicted figures.

    A preset is checked on its analytic figures first (instant, before tracing a large model), then every
    source on the traces of its runs' steps. ``steps``: the steps each run takes (the CPU's time check).
    ``compiled`` (``model`` or ``block``) and ``budget``: the runs are compiled steps, each also traced compiled
    (``trace_compiled``, its peak too), which the predicted peaks and overheads are then of.

    Raises:
        ConfigError: the largest run's step needs more memory than ``device`` has free (on CUDA what the caching
            allocator is predicted to reserve), or, on the CPU, the runs would take over ``max_minutes``. (A
            PyTorch that cannot trace a compiled step's peak, before 2.8, is refused by ``bench`` first.)
    """
    spec = source.spec if all(wl.precision != AMP for wl, _ in runs) else None  # the formulas take one dtype
    analytic = tuple(estimate(spec, as_run(wl), pol) for wl, pol in runs) if spec is not None else None
    if spec is not None and analytic is not None:
        fix = _smaller(spec, runs, device)
        require_memory(max(e.peak for e in analytic), device, what="bench", fix=fix, fields=SIZE_FIELDS)
        _require_time_of(runs, [e.hardware_flops for e in analytic], device, steps, max_minutes)
    traces = tuple(trace(source, as_run(wl), pol) for wl, pol in runs)
    fix = "use a shorter seq_len, a smaller micro_batch or a smaller model"
    require_memory(traced_need(traces), device, what="bench", fix=fix, fields=("seq_len", "micro_batch"))
    if spec is None:  # Kaplan et al.'s 6 N T, and a forward's 2 N T more for a policy that replays
        per_token = [(6 + 2 * (pol.name not in ("none", "offload"))) * traces[0].parameter_count for _, pol in runs]
        _require_time_of(runs, [f * wl.tokens for f, (wl, _) in zip(per_token, runs)], device, steps, max_minutes)
    if compiled is not None:
        return _compiled(source, runs, device, traces, compiled, budget, fix)
    if source.spec is not None and spec is None:
        return Predicted(traces, None, "the analytic model describes one-dtype steps, not autocast's (amp)")
    return Predicted(traces, analytic)


def _compiled(
    source: ModelSource,
    runs: Runs,
    device: str,
    traces: tuple[TraceResult, ...],
    compiled: str,
    budget: float | None,
    fix: str,
) -> Predicted:
    """``predict``'s compiled runs: each step traced compiled, the memory checked on the larger prediction."""
    found = tuple(
        trace_compiled(source, as_run(wl), pol, budget=budget, per_block=compiled == "block", peak=True)
        for wl, pol in runs
    )
    need = max(compiled_peak(t, c) for t, c in zip(traces, found))
    require_memory(need, device, what="bench", fix=fix, fields=("seq_len", "micro_batch"))
    return Predicted(traces, None, "the analytic model describes eager steps, not compiled ones", found)


def _require_time_of(runs: Runs, flops: Sequence[float], device: str, steps: Sequence[int], minutes: float) -> None:
    """``require_time`` for a CPU run (a GPU's time is not checked), in the runs' dtype."""
    if device == "cpu":
        require_time([f * n for f, n in zip(flops, steps)], runs[0][0].dtype, max_minutes=minutes)


def require_time(flops: Sequence[float], dtype: str, *, max_minutes: float = MAX_MINUTES) -> None:
    """Refuse a CPU bench whose FLOPs (each run's, all its steps) would take over ``max_minutes`` here.

    The time is a lower bound: the FLOPs at this CPU's rate of a large ``dtype`` matmul (``matmul_rate``), which
    a training step's smaller matmuls, attention and element-wise ops do not reach.

    Raises:
        ConfigError: the predicted time exceeds ``max_minutes``; the message gives both, the rate and the fixes.
    """
    rate = matmul_rate("cpu", dtype)
    minutes = sum(flops) / rate / 60
    if minutes > max_minutes:
        raise ConfigError(
            f"bench would take at least about {minutes:,.0f} min here ({sum(flops) / 1e12:,.1f} TFLOP at this "
            f"CPU's {rate / 1e9:,.1f} GFLOP/s {dtype} matmul rate), over max_minutes {max_minutes:g}; use a shorter "
            "seq_len, a smaller micro_batch, fewer policies or steps or a smaller model, or raise max_minutes",
            fields=("seq_len", "micro_batch", "policies", "steps", "max_minutes"),
        )


@functools.cache
def matmul_rate(device: str, dtype: str) -> float:
    """FLOP/s of a square ``dtype`` matmul on ``device``, measured once a process: the size doubled from 256 until
    one product takes 0.1 s (or n = 2048), the best of three at that size (a second or two on a CPU)."""
    n = 256
    while True:
        a = torch.ones(n, n, dtype=TORCH_DTYPES[dtype], device=device)
        best = min(_timed_matmul(a, device) for _ in range(3))
        if best >= 0.1 or n >= 2048:
            return 2 * n**3 / best
        n *= 2


def _timed_matmul(a: torch.Tensor, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    a @ a
    sync(device)
    return time.perf_counter() - start


def traced_need(traces: Sequence[TraceResult]) -> float:
    """Bytes ``bench`` will hold at most, from the traces of its runs: the largest step's peak, or on CUDA what the
    caching allocator is predicted to reserve for it. One run is alive at a time."""
    return float(max(t.reserved if t.reserved is not None else t.peak for t in traces))


def predicted_need(spec: ModelSpec, runs: Runs) -> float:
    """Bytes ``bench`` will hold at most, from the analytic model: the largest run's predicted peak.

    One run's model and AdamW state are alive at a time (gradients are freed between steps).
    """
    return max(estimate(spec, as_run(wl), pol).peak for wl, pol in runs)


def _smaller(spec: ModelSpec, runs: Runs, device: str) -> str:
    """The fix to suggest: the longest sequence that fits (halving), else a smaller model."""
    have = HEADROOM * available_memory(device)
    s = runs[0][0].seq_len // 2
    while s >= 16:
        if predicted_need(spec, [(dataclasses.replace(wl, seq_len=s), pol) for wl, pol in runs]) <= have:
            return f"use seq_len {s} or less, or a smaller model (n_layers, hidden)"
        s //= 2
    return (
        "use a smaller model (n_layers, hidden, vocab) or a smaller micro_batch, "
        "or `recompute trace` (fake tensors, any size) or `recompute estimate`"
    )

"""``recompute validate``: the analytic model against the trace, per layer and component, with the error.

For every preset, policy and attention implementation at two sequence lengths, one layer's saved bytes from
``recompute.core.analytic.layer_activations`` are compared with what the real PyTorch forward saves on fake
tensors (``recompute.trace.trace_layer``), component by component. The trace is the arbiter: where they
disagree the formula is fixed or its limit is stated in docs/validation.md.

Targets: per-layer bytes within 3 % for GPT-style presets and within 5 % for Llama presets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from recompute.core.analytic import estimate
from recompute.core.analytic.memory import ATTENTION, MLP, NORMS, LayerActivations, layer_activations
from recompute.core.policy import POLICIES
from recompute.core.presets import PRESETS
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.table import GiB, MiB, render_table
from recompute.core.workload import ATTENTIONS, Workload
from recompute.trace import trace, trace_layer

__all__ = [
    "TARGETS",
    "PeakRow",
    "Validation",
    "ValidationRow",
    "analytic_components",
    "render_validation",
    "validate",
]

TARGETS = {"gpt": 0.03, "llama": 0.05}
"""Largest relative error allowed on a layer's total, by preset family."""

COMPARED = ("attention", "mlp", "norms", "checkpoint")


def family(spec: ModelSpec) -> str:
    """``llama`` for SwiGLU presets, ``gpt`` for the GELU ones (GPT-2, GPT-3 and the paper's)."""
    return "llama" if spec.mlp == "swiglu" else "gpt"


def seq_lens(spec: ModelSpec) -> tuple[int, int]:
    """Two sequence lengths per preset: its context (at most 8192) and half of it."""
    top = min(spec.max_positions, 8192)
    return top // 2, top


def analytic_components(la: LayerActivations, policy: str) -> dict[str, float]:
    """The analytic layer in the trace's components: a sub-block's checkpoint belongs to that sub-block.

    The trace files a tensor under the child module running when it was saved, so the input a recomputed
    attention or MLP keeps is ``attention`` or ``mlp``; only a whole-layer checkpoint is ``checkpoint``.
    """
    parts = la.stored_by_component(policy)
    out = {
        "attention": sum(parts.get(c, 0.0) for c in ATTENTION),
        "mlp": sum(parts.get(c, 0.0) for c in MLP),
        "norms": sum(parts.get(c, 0.0) for c in NORMS),
        "checkpoint": 0.0,
    }
    if policy == "block":
        out["checkpoint"] = parts.get("checkpoint", 0.0)
    if policy in ("attn", "attn+mlp"):
        out["attention"] += la.attn_in
    if policy in ("mlp", "attn+mlp"):
        out["mlp"] += la.mlp_in
    return out


@dataclass(frozen=True)
class ValidationRow:
    """One layer of one configuration: analytic and traced bytes per component and in total."""

    model: str
    family: str
    policy: str
    attention: str
    seq_len: int
    micro_batch: int
    analytic: dict[str, float]
    traced: dict[str, int]

    @property
    def error(self) -> float:
        """Relative error of the analytic total: (analytic - traced) / traced."""
        return _rel(sum(self.analytic.values()), sum(self.traced.values()))

    def component_error(self, component: str) -> float:
        return _rel(self.analytic.get(component, 0.0), self.traced.get(component, 0))

    @property
    def passed(self) -> bool:
        return abs(self.error) <= TARGETS[self.family]

    def to_dict(self) -> dict[str, Any]:
        errors = {c: self.component_error(c) for c in COMPARED}
        return dict(asdict(self), error=self.error, component_errors=errors, passed=self.passed)


@dataclass(frozen=True)
class PeakRow:
    """The whole step's peak of one configuration: ``recompute estimate`` against a trace.

    Both sides run the same step (gradients freed between steps unless ``keep_grads``), and the trace
    holds parameters, gradients and AdamW state in the activation dtype (``precision`` fp32 or bf16).
    """

    model: str
    family: str
    policy: str
    attention: str
    seq_len: int
    micro_batch: int
    analytic: float
    analytic_phase: str
    traced: int
    traced_phase: str

    @property
    def error(self) -> float:
        return _rel(self.analytic, self.traced)

    @property
    def passed(self) -> bool:
        return abs(self.error) <= TARGETS[self.family]

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), error=self.error, passed=self.passed)


def _rel(analytic: float, traced: float) -> float:
    if traced == 0:
        return 0.0 if analytic == 0 else float("inf")
    return (analytic - traced) / traced


@dataclass(frozen=True)
class Validation:
    """All rows, and the worst error per family."""

    rows: tuple[ValidationRow, ...]
    peaks: tuple[PeakRow, ...] = ()

    def max_error(self, fam: str, *, peaks: bool = False) -> float:
        """Largest |relative error| of a layer's total (or of the peak) among ``fam``'s rows (0 if none)."""
        rows: Sequence[ValidationRow | PeakRow] = self.peaks if peaks else self.rows
        return max((abs(r.error) for r in rows if r.family == fam), default=0.0)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows) and all(r.passed for r in self.peaks)

    def to_dict(self) -> dict[str, Any]:
        fams = sorted({r.family for r in self.rows})
        return {
            "targets": TARGETS,
            "max_error": {f: self.max_error(f) for f in fams},
            "max_peak_error": {f: self.max_error(f, peaks=True) for f in fams} if self.peaks else {},
            "passed": self.passed,
            "rows": [r.to_dict() for r in self.rows],
            "peaks": [r.to_dict() for r in self.peaks],
        }


def validate(
    models: Sequence[str] = tuple(PRESETS),
    *,
    policies: Sequence[str] = tuple(POLICIES),
    attentions: Sequence[str] = ATTENTIONS,
    lengths: Sequence[int] | None = None,
    micro_batch: int = 1,
    dtype: str = "bf16",
    peaks: bool = False,
    keep_grads: bool = False,
    progress: Progress = no_progress,
) -> Validation:
    """Compare analytic and traced per-layer bytes for every combination (CPU, fake tensors).

    Args:
        models: preset names.
        lengths: sequence lengths; ``None`` means ``seq_lens(spec)`` for each model.
        peaks: also compare the whole step's peak with ``recompute estimate`` (a scaled trace per
            configuration, a few seconds each).
        keep_grads: the step whose peak is compared keeps its gradients allocated between steps.
        progress: called before each configuration with its label and how many are done (of all).
    """
    rows, peak_rows = [], []
    configs = list(_configs(models, policies, attentions, lengths, micro_batch, dtype))
    for i, (name, spec, wl, policy) in enumerate(configs):
        progress(f"{name} s={wl.seq_len} {wl.attention} {policy}", i, len(configs))
        traced = trace_layer(spec, wl, policy).components
        analytic = analytic_components(layer_activations(spec, wl), policy)
        rows.append(
            ValidationRow(
                model=name,
                family=family(spec),
                policy=policy,
                attention=wl.attention,
                seq_len=wl.seq_len,
                micro_batch=micro_batch,
                analytic=analytic,
                traced={c: traced.get(c, 0) for c in COMPARED},
            )
        )
        if peaks:
            peak_rows.append(_peak_row(name, spec, dataclasses.replace(wl, keep_grads=keep_grads), policy))
    return Validation(rows=tuple(rows), peaks=tuple(peak_rows))


def _peak_row(name: str, spec: ModelSpec, wl: Workload, policy: str) -> PeakRow:
    wl = dataclasses.replace(wl, precision="fp32" if wl.dtype == "fp32" else "bf16")
    predicted = estimate(spec, wl, policy)
    traced = trace(spec, wl, policy, layers=min(2, spec.n_layers))
    return PeakRow(
        model=name,
        family=family(spec),
        policy=policy,
        attention=wl.attention,
        seq_len=wl.seq_len,
        micro_batch=wl.micro_batch,
        analytic=predicted.peak,
        analytic_phase=predicted.peak_phase,
        traced=traced.peak,
        traced_phase=traced.peak_phase,
    )


def _configs(
    models: Iterable[str],
    policies: Sequence[str],
    attentions: Sequence[str],
    lengths: Sequence[int] | None,
    micro_batch: int,
    dtype: str,
) -> Iterable[tuple[str, ModelSpec, Workload, str]]:
    for name in models:
        spec = ModelSpec.from_name(name)
        for s in lengths or seq_lens(spec):
            for attention in attentions:
                wl = Workload(micro_batch=micro_batch, seq_len=s, dtype=dtype, attention=attention, device="cpu")
                for policy in policies:
                    yield name, spec, wl, policy


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def render_validation(v: Validation, *, components: bool = False) -> str:
    """One row per configuration (total error; per-component errors with ``components``), then the summary."""
    comp_headers = [f"{c} err" for c in COMPARED] if components else []
    rows = [
        [
            r.model,
            str(r.seq_len),
            r.attention,
            r.policy,
            f"{sum(r.analytic.values()) / MiB:,.1f}",
            f"{sum(r.traced.values()) / MiB:,.1f}",
            _pct(r.error),
            *(_pct(r.component_error(c)) for c in COMPARED if components),
        ]
        for r in v.rows
    ]
    headers = ["model", "s", "attention", "policy", "analytic MiB", "traced MiB", "error", *comp_headers]
    summary = [
        f"{f}: max |error| {100 * v.max_error(f):.2f}% (target {100 * TARGETS[f]:.0f}%)"
        for f in sorted({r.family for r in v.rows})
    ]
    verdict = "all within target" if v.passed else "some rows exceed their target"
    return "\n".join([render_table(headers, rows), "", *_render_peaks(v), *summary, verdict])


def _render_peaks(v: Validation) -> list[str]:
    if not v.peaks:
        return []
    rows = [
        [r.model, str(r.seq_len), r.attention, r.policy, f"{r.analytic / GiB:,.2f}", r.analytic_phase,
         f"{r.traced / GiB:,.2f}", r.traced_phase, _pct(r.error)]
        for r in v.peaks
    ]  # fmt: skip
    headers = ["model", "s", "attention", "policy", "analytic GiB", "at", "traced GiB", "at", "error"]
    summary = [
        f"{f} peaks: max |error| {100 * v.max_error(f, peaks=True):.2f}%" for f in sorted({r.family for r in v.peaks})
    ]
    return [render_table(headers, rows), "", *summary]

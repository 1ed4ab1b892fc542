"""The report's numbers: every series the page and the PNGs draw, computed from ``recompute.core.analytic``.

Nothing here formats or writes: ``build_report`` returns a ``Report`` of plain numbers (bytes, fractions),
``Report.to_dict`` is what the page embeds as JSON, and ``render_html`` / ``write_pngs`` only draw it.
Torch-free and plotly-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recompute.core.analytic import Estimate, estimate, layer_overheads, n_params, overhead_from_flops
from recompute.core.errors import ConfigError
from recompute.core.hardware import GPU, gpu_by_name, usable_bytes
from recompute.core.policy import POLICIES
from recompute.core.presets import PRESETS
from recompute.core.spec import ModelSpec
from recompute.core.timing import Timing
from recompute.core.workload import ATTENTIONS, Workload

__all__ = [
    "COMPONENTS",
    "STRATEGIES",
    "GpuLine",
    "ModelSeries",
    "PolicyMemory",
    "Report",
    "SavingRow",
    "WorkedExample",
    "build_report",
    "components",
    "family",
    "model_series",
    "sequence_lengths",
    "worked_example",
]

COMPONENTS: dict[str, str] = {
    "parameters": "Parameters",
    "gradients": "Gradients",
    "optimizer": "Optimizer",
    "outside": "Embedding, head, logits",
    "checkpoints": "Checkpoints",
    "norms": "Norms",
    "mlp": "MLP",
    "attention": "Attention",
}
"""Stacked from the bottom up, as on the workshop page; ``outside`` is what lives outside the layers."""

STRATEGIES: dict[str, str] = {"attn": "A: recompute attention", "mlp": "B: recompute MLP", "attn+mlp": "C: both"}
"""The workshop's three strategies, by policy name."""

MAX_SEQ_LEN = 131072  # 128K, the longest context of the Llama 3.1 family
MIN_POINTS = 4


def family(spec: ModelSpec) -> tuple[ModelSpec, ...]:
    """The sizes the page's model switch offers: the presets that share ``spec``'s source, in preset order.

    Llama 3.1 gives 8B / 70B / 405B, GPT-2 its four sizes, the paper its four configurations; a model read
    from a config.json (or a preset with its own source) stands alone.
    """
    row = PRESETS.get(spec.name)
    if row is None or ModelSpec.from_name(spec.name) != spec:
        return (spec,)
    return tuple(ModelSpec.from_name(n) for n, r in PRESETS.items() if r.get("source") == row.get("source"))


def sequence_lengths(spec: ModelSpec, wl: Workload) -> tuple[int, ...]:
    """Powers of two from 1K to 128K that the model takes; at least four points (starting below 1K if need be).

    With sequence parallelism only lengths divisible by the tensor-parallel size are kept.
    """
    top = min(MAX_SEQ_LEN, spec.max_positions)
    lengths = [2**k for k in range(31) if 2**k <= top]
    first = min(1024, 2 ** max(0, len(lengths) - MIN_POINTS))
    return tuple(s for s in lengths if s >= first and (not wl.sp or s % wl.tp == 0))


def components(est: Estimate) -> dict[str, float]:
    """An estimate's ``total`` (model states + stored activations) split into ``COMPONENTS``; sums to it."""
    act = est.activations
    inside = {"checkpoints": act.get("checkpoint", 0.0), "norms": act.get("norms", 0.0)}
    inside.update(mlp=act.get("mlp", 0.0), attention=act.get("attention", 0.0))
    return {
        "parameters": est.states.parameters,
        "gradients": est.states.gradients,
        "optimizer": est.states.optimizer,
        "outside": est.activation_bytes - sum(inside.values()),
        **inside,
    }


@dataclass(frozen=True)
class PolicyMemory:
    """Memory of one policy at each sequence length of a ``ModelSeries`` (bytes per rank)."""

    components: dict[str, list[float]]
    """``COMPONENTS`` key -> bytes at each length; the stack sums to ``total``."""
    total: list[float]
    """Model states + stored activations (``Estimate.total``)."""
    peak: list[float]
    """Predicted peak with the recompute and loss transients (``Estimate.peak``)."""


@dataclass(frozen=True)
class SavingRow:
    """One row of the workshop's "memory saved per % of compute overhead" table."""

    policy: str
    saved: float
    """Stored activation bytes saved against ``none``."""
    overhead: float
    """Recompute FLOPs over the step's model FLOPs (``Estimate.overhead``), a fraction."""
    per_percent: float | None
    """``saved`` per 1 % of overhead, in bytes; None when nothing is recomputed."""
    time_overhead: float | None = None
    """The time model's overhead on the report's device (``recompute.core.timing``); None when not predicted."""
    step_seconds: float | None = None
    """The time model's step time there."""


@dataclass(frozen=True)
class ModelSeries:
    """Everything the page shows for one model size."""

    name: str
    params: int
    seq_lens: list[int]
    table_seq_len: int
    """Where the savings table is taken (the workshop: 16K)."""
    memory: dict[str, dict[str, PolicyMemory]]
    """attention (``eager``/``flash``) -> policy -> memory across ``seq_lens``."""
    overhead: dict[str, list[float]]
    """policy -> step overhead (recompute over model FLOPs, logits included) across ``seq_lens``."""
    layer_overhead: dict[str, list[float]]
    """policy -> the workshop's per-layer F_recomputed / 3F across ``seq_lens``."""
    savings: dict[str, list[SavingRow]]
    """attention -> the savings table at ``table_seq_len``."""
    activations: dict[str, float]
    """attention -> activation bytes stored with ``none`` at ``table_seq_len`` (what the savings are out of)."""


def _policy_memory(estimates: list[Estimate]) -> PolicyMemory:
    parts = [components(e) for e in estimates]
    return PolicyMemory(
        components={k: [p[k] for p in parts] for k in COMPONENTS},
        total=[e.total for e in estimates],
        peak=[e.peak for e in estimates],
    )


def _savings(spec: ModelSpec, wl: Workload, times: Mapping[str, Timing] | None = None) -> list[SavingRow]:
    """A row per recompute policy, then the two other ways to fit a step: the chunked loss (the logits never
    all alive; no FLOPs, its price is its own step time) and offload (every layer's saved tensors in host
    memory, copied back in the backward: no FLOPs, its price is copy time)."""
    none = estimate(spec, wl, "none")
    alternatives = {"offload": estimate(spec, wl, "offload")}
    if wl.dtype != "fp16":  # the chunked loss refuses fp16 (its gradients would underflow before a loss scaler)
        alternatives = {"chunked loss": estimate(spec, dataclasses.replace(wl, loss="chunked"), "none"), **alternatives}
    rows = []
    for name, est in [*((p, estimate(spec, wl, p)) for p in POLICIES if p != "none"), *alternatives.items()]:
        saved = none.activation_bytes - est.activation_bytes
        t = times.get(name) if times else None
        rows.append(
            SavingRow(
                name,
                saved,
                est.overhead,
                saved / (100 * est.overhead) if est.overhead else None,
                t.overhead if t else None,
                t.step if t else None,
            )
        )
    return rows


def model_series(
    spec: ModelSpec,
    wl: Workload,
    *,
    table_seq_len: int,
    times: Mapping[str, Mapping[str, Timing]] | None = None,
) -> ModelSeries:
    """All of one model's series under ``wl`` (its ``seq_len`` and ``attention`` are swept); ``times``: per
    attention and policy, the predicted timing at ``table_seq_len`` for the savings table.

    Raises:
        ConfigError: ``wl`` cannot run ``spec`` (``Workload.check``).
    """
    lengths = sequence_lengths(spec, wl)
    if not lengths:
        raise ConfigError(f"no sequence length of {spec.name} up to 128K is divisible by --tp {wl.tp} (--sp)")
    dataclasses.replace(wl, seq_len=lengths[-1]).check(spec)
    at = {a: [dataclasses.replace(wl, seq_len=s, attention=a) for s in lengths] for a in ATTENTIONS}
    ests = {a: {p: [estimate(spec, w, p) for w in at[a]] for p in POLICIES} for a in ATTENTIONS}
    per_layer = [layer_overheads(spec, w) for w in at["eager"]]
    table = min(table_seq_len, spec.max_positions)
    at_table = {a: dataclasses.replace(wl, seq_len=table, attention=a) for a in ATTENTIONS}
    return ModelSeries(
        name=spec.name,
        params=n_params(spec),
        seq_lens=list(lengths),
        table_seq_len=table,
        memory={a: {p: _policy_memory(e) for p, e in by_policy.items()} for a, by_policy in ests.items()},
        overhead={p: [e.overhead for e in ests["eager"][p]] for p in POLICIES},
        layer_overhead={p: [lo[p] for lo in per_layer] for p in POLICIES},
        savings={a: _savings(spec, at_table[a], (times or {}).get(a)) for a in ATTENTIONS},
        activations={a: estimate(spec, at_table[a], "none").activation_bytes for a in ATTENTIONS},
    )


@dataclass(frozen=True)
class WorkedExample:
    """The workshop's worked example: per-layer forward FLOPs of attention and MLP, and what each strategy adds."""

    attention: float
    mlp: float
    step: float
    """Baseline step FLOPs, 3 x (attention + MLP)."""
    rows: dict[str, float]
    """Strategy policy name -> overhead fraction (``overhead_from_flops``)."""


def worked_example(attention: float = 100.0, mlp: float = 300.0) -> WorkedExample:
    """Attention 100 and MLP 300: attn +8.3 %, mlp +25 %, both +33.3 %."""
    rows = {p: overhead_from_flops(attention, mlp, p) for p in STRATEGIES}
    return WorkedExample(attention=attention, mlp=mlp, step=3 * (attention + mlp), rows=rows)


@dataclass(frozen=True)
class GpuLine:
    """The GPU whose memory the breakdown chart draws as a line."""

    name: str
    label: str
    memory: float
    usable: float
    """``hardware.usable_bytes``: memory less the CUDA context and a fragmentation allowance."""
    source: str

    @classmethod
    def of(cls, gpu: str | GPU) -> GpuLine:
        row = gpu_by_name(gpu)
        return cls(row.name, row.label, row.memory, usable_bytes(row), row.source)


@dataclass(frozen=True)
class Report:
    """The page's data: one chosen model, its family, the workload, the GPU and the optional sections."""

    model: str
    workload: dict[str, Any]
    gpu: GpuLine
    models: dict[str, ModelSeries]
    """Family member name -> series, in switch order; ``model`` is one of them."""
    worked: WorkedExample
    components: dict[str, str] = field(default_factory=lambda: dict(COMPONENTS))
    policies: dict[str, str] = field(default_factory=lambda: dict(POLICIES))
    strategies: dict[str, str] = field(default_factory=lambda: dict(STRATEGIES))
    skipped: dict[str, str] = field(default_factory=dict)
    """Family members left out, with the reason (e.g. the tensor-parallel size does not divide their heads)."""
    sections: dict[str, Any] = field(default_factory=dict)
    """Optional ``trace``, ``bench`` and ``plan`` sections (plain JSON-ready dicts, see ``report.extras``)."""
    answer: dict[str, Any] | None = None
    """The first screen: what fits the GPU (``report.answer.answer_data``)."""
    analytic: str = ""
    """Why the charts are missing when the analytic model does not read the model ("" when they are drawn)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data, embedded in the page as ``<script type="application/json" id="data">``."""
        return dataclasses.asdict(self)


def build_report(
    spec: ModelSpec | str,
    wl: Workload,
    *,
    gpu: str | GPU = "h100-80gb",
    sections: dict[str, Any] | None = None,
    times: Mapping[str, Mapping[str, Timing]] | None = None,
    answer: dict[str, Any] | None = None,
    analytic: str = "",
) -> Report:
    """Compute every series of the page for ``spec`` and its family under ``wl``.

    ``wl.seq_len`` is where the savings table is taken (clipped to each size's context); the charts sweep
    ``sequence_lengths``. ``wl.attention`` only picks what the page shows first. ``times``: ``spec``'s predicted
    timings per attention and policy at the table's length (the other sizes show none). ``spec`` may be a
    model's name alone, for a model the analytic model does not read (``analytic`` says why): the page is then
    its ``answer`` and its sections.

    Raises:
        ConfigError: unknown GPU, or ``wl`` cannot run ``spec`` itself (other sizes that it cannot run are
        listed in ``Report.skipped``).
    """
    if isinstance(spec, str):
        return Report(
            model=spec,
            workload=wl.to_dict(),
            gpu=GpuLine.of(gpu),
            models={},
            worked=worked_example(),
            sections=dict(sections or {}),
            answer=answer,
            analytic=analytic or "the analytic model does not read this model",
        )
    wl.check(spec)
    models, skipped = {}, {}
    for member in family(spec):
        try:
            own = times if member.name == spec.name else None
            models[member.name] = model_series(member, wl, table_seq_len=wl.seq_len, times=own)
        except ConfigError as e:
            if member.name == spec.name:
                raise
            skipped[member.name] = str(e)
    return Report(
        model=spec.name,
        workload=wl.to_dict(),
        gpu=GpuLine.of(gpu),
        models=models,
        worked=worked_example(),
        skipped=skipped,
        sections=dict(sections or {}),
        answer=answer,
    )

"""Estimates and plans as text (no heavy imports, so ``recompute estimate`` and ``plan`` start fast)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from recompute.core.analytic.estimate import Estimate
from recompute.core.plan import Plan, PlanPoint
from recompute.core.pricing import StepTime
from recompute.core.profile import Profile
from recompute.core.spec import ModelSpec
from recompute.core.table import gib, render_table, size
from recompute.core.timing import Device, Timing
from recompute.core.workload import Workload, build_workload, step_dtype

__all__ = [
    "apply_line",
    "describe_workload",
    "device_note",
    "layer_runs",
    "render_estimate",
    "render_plan",
    "render_profile",
    "render_step",
    "seconds",
    "time_cells",
]


def device_note(device: Device, wl: Workload | None = None) -> str:
    """One line saying where times are predicted and from what (the host's dispatch included)."""
    kind = "calibrated" if device.source.startswith("calibrated") else "datasheet roofline"
    traced = ""
    if wl is not None and wl.device == "cuda" and device.kind != "cpu":
        traced = "; kernels from the fake-tensor trace of the step"
    return (
        f"times: predicted on {device.label} ({kind}; see docs/time.md for what the model ignores){traced}; "
        f"{device.host_note()}"
    )


def describe_workload(model: str, wl: Workload) -> str:
    """One line naming the model and the step's shape."""
    parallel = f"t={wl.tp}{' +sp' if wl.sp else ''} p={wl.pp}" + (f" m={wl.interleave}" if wl.interleave > 1 else "")
    return (
        f"{model}: b={wl.micro_batch} s={wl.seq_len} {step_dtype(wl.dtype, wl.precision)} on {wl.device}, "
        f"{wl.attention} attention, "
        f"{parallel} d={wl.dp}, {wl.precision} precision"
    )


def _saved_per_pct(base: Estimate, e: Estimate, overhead: float) -> str:
    if overhead <= 0:
        return "-"
    return gib((base.activation_bytes - e.activation_bytes) / (100 * overhead))


def render_estimate(
    spec: ModelSpec,
    wl: Workload,
    rows: Sequence[Estimate],
    chosen: Estimate,
    times: Sequence[Timing] | None = None,
    time_note: str = "",
) -> str:
    """The policy table (with predicted ``times`` per row when given), then the breakdown of ``chosen``."""
    base = next((e for e in rows if e.policy == "none"), rows[0])
    timed = ["step time", "tokens/s", "time overhead"] if times else []
    per = ["saved per 1% FLOPs", *(["per 1% time"] if times else [])]
    table = render_table(
        ["policy", "activations", "total", "peak", "FLOP overhead", *timed, *per],
        [
            [
                e.policy,
                gib(e.activation_bytes),
                gib(e.total),
                gib(e.peak),
                f"{100 * e.overhead:.1f}%",
                *(time_cells(times[i]) if times else []),
                _saved_per_pct(base, e, e.overhead),
                *([_saved_per_pct(base, e, times[i].overhead)] if times else []),
            ]
            for i, e in enumerate(rows)
        ],
    )
    st = chosen.states
    lines = [
        describe_workload(spec.name, wl),
        f"model states: {gib(st.total)} for {st.params / 1e9:.3g}B parameters on this rank "
        f"(parameters {gib(st.parameters)}, gradients {gib(st.gradients)}, optimizer {gib(st.optimizer)})",
        "",
        table,
        "",
        f"breakdown of {chosen.policy} (per rank, first pipeline stage):",
        render_table(
            ["component", "bytes"],
            [[k, gib(v)] for k, v in chosen.activations.items() if v]
            + [
                ["activations", gib(chosen.activation_bytes)],
                ["model states", gib(st.total)],
                [f"peak ({chosen.peak_phase})", gib(chosen.peak)],
                *([["host memory (offloaded)", gib(chosen.host)]] if chosen.host else []),
            ],
        ),
        "",
        f"FLOPs per micro-batch: model {chosen.model_flops:.3e}, recomputed {chosen.recompute_flops:.3e} "
        f"(+{100 * chosen.overhead:.1f}%)",
        *([time_note] if time_note else []),
        *(f"note: {n}" for n in chosen.notes),
    ]
    return "\n".join(lines)


def render_step(policy: str, st: StepTime, collectives: Sequence[dict[str, Any]]) -> str:
    """How a step's predicted time adds up, and the collectives of one micro-batch on one rank."""
    parts = [f"compute {seconds(st.compute)}"]
    if st.comm:
        parts.append(f"collectives {seconds(st.tp)} exposed of {seconds(st.comm - st.p2p)}")
    if st.p2p:
        parts.append(f"pipeline sends {seconds(st.p2p)}")
    line = f"step of {policy}: {seconds(st.step)} = {st.microbatches} micro-batch(es)"
    if st.bubble:
        line += f" + bubble {st.bubble:g}"
    line += f" x {seconds(st.microbatch)} ({', '.join(parts)}) + optimizer {seconds(st.optimizer)}"
    if st.dp:
        line += f" + data-parallel reduction {seconds(st.dp)} exposed"
    if not collectives:
        return line
    shown = "; ".join(
        f"{r['phase']} {r['count']} {r['kind']} ({r['group']}, {r['ranks']} ranks, {gib(r['bytes'])})"
        for r in collectives
    )
    return f"{line}\ncollectives of one micro-batch on one rank: {shown}"


def time_cells(t: Timing) -> list[str]:
    """Step time, tokens/s and time overhead of one prediction, as table cells."""
    return [seconds(t.step), f"{t.tokens_per_second:,.0f}", f"{100 * t.overhead:+.1f}%"]


def seconds(value: float) -> str:
    """``812 ms``, ``1.42 s``, ``37.1 us``."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.1f} us"


def layer_runs(layers: Sequence[str]) -> str:
    """``block x10 (layers 0-9), none x2 (10-11)``: a per-layer policy in runs."""
    runs: list[tuple[str, int, int]] = []
    for i, name in enumerate(layers):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], i)
        else:
            runs.append((name, i, i))
    return ", ".join(f"{n} (layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''})" for n, a, b in runs)


def render_plan(
    plan: Plan,
    wl: Workload,
    *,
    breakdown: Estimate | None = None,
    output: str | None = None,
    notes: Sequence[str] = (),
    points: int = 12,
) -> str:
    """The answer first (the plan, its peak against the budget, its cost, the line that applies it), then the
    analytic breakdown (a preset), a sample of the frontier, the uniform policies and the notes."""
    timed = plan.timed
    over = "time overhead" if timed else "FLOP overhead"
    losses = len({p.loss for p in plan.frontier}) > 1 or plan.loss != wl.loss
    sample = sorted({*_sample(plan.frontier, points), plan.chosen}, key=lambda p: (p.peak, p.cost))

    def cells(p: PlanPoint) -> list[str]:
        step = [seconds(p.step_seconds), f"{plan.tokens / p.step_seconds:,.0f}"] if p.step_seconds else []
        return [f"{100 * p.overhead:+.1f}%" if timed else f"{100 * p.overhead:.1f}%", *step]

    heads = [over, *(["step time", "tokens/s"] if timed else [])]
    frontier = render_table(
        ["", "peak", *heads, *(["loss"] if losses else []), "plan (first pipeline stage)"],
        [
            ["*" if p == plan.chosen else "", gib(p.peak), *cells(p), *([p.loss] if losses else []), _counts(p.layers)]
            for p in sample
        ],
    )
    uniform = render_table(
        ["every layer", "peak", *heads, "fits"],
        [[n, gib(p.peak), *cells(p), "yes" if p.peak <= plan.budget else "no"] for n, p in plan.uniform.items()],
    )
    lines = [
        describe_workload(plan.model, build_workload(**plan.workload)),
        f"plan: {layer_runs(plan.layers)}" + ("; chunked loss" if plan.loss == "chunked" else ""),
        f"fits: predicted peak {gib(plan.peak)} of the {gib(plan.budget)} budget ({plan.peak_phase})"
        + (f"; traced peak {gib(plan.traced_peak)}" if plan.traced_peak is not None else "")
        + (f", reserved {gib(plan.traced_reserved)} (CUDA's caching allocator)" if plan.traced_reserved else ""),
        "cost: " + _plan_cost(plan),
        "apply: " + apply_line(plan, output),
    ]
    if breakdown is not None:
        lines += ["", _breakdown(breakdown)]
    lines += [
        "",
        f"frontier ({len(plan.frontier)} plans, none both smaller and cheaper; {len(sample)} shown, * = chosen"
        + ("; --frontier for all" if len(sample) < len(plan.frontier) else "")
        + "):",
        frontier,
        "",
        uniform,
        f"source: {plan.source}; costs in {plan.cost_kind}",
        *([Device.from_dict(plan.device).host_note()] if timed and plan.device else []),
        *(f"note: {n}" for n in notes),
    ]
    return "\n".join(lines)


def _plan_cost(plan: Plan) -> str:
    flops = f"recompute {plan.recompute_flops / plan.model_flops:.1%} of the step's FLOPs"
    step = plan.chosen.step_seconds
    if step is None:
        return flops if plan.cost_kind == "FLOPs" else f"{plan.overhead:+.1%} ({plan.cost_kind}); {flops}"
    return f"{plan.overhead:+.1%} time: step {seconds(step)}, {plan.tokens / step:,.0f} tokens/s ({flops})"


def apply_line(plan: Plan, output: str | None) -> str:
    """The line that applies the plan in a training script (or how to get the file it reads)."""
    loss = ', loss="chunked"' if plan.loss == "chunked" else ""
    if output is None:
        return f'write it with -o plan.json, then recompute.apply(model, "plan.json"{loss})'
    return f"recompute.apply(model, {output!r}{loss})"


def _breakdown(est: Estimate) -> str:
    return render_table(
        ["component", "bytes"],
        [[k, gib(v)] for k, v in est.activations.items() if v]
        + [["model states", gib(est.states.total)]]
        + ([["host memory (offloaded)", gib(est.host)]] if est.host else []),
    )


def _counts(layers: Sequence[str]) -> str:
    return ", ".join(f"{n} x{layers.count(n)}" for n in dict.fromkeys(layers))


def _sample(points: Sequence[PlanPoint], n: int) -> list[PlanPoint]:
    """Up to ``n`` points spread evenly along the frontier, always with both ends."""
    if len(points) <= n:
        return list(points)
    step = (len(points) - 1) / (n - 1)
    return [points[round(i * step)] for i in range(n)]


def _flops(n: float) -> str:
    return f"{n / 1e12:.2f} TF" if abs(n) >= 1e11 else f"{n / 1e9:.2f} GF"


def render_profile(
    profile: Profile, device: Device | None = None, *, offload: Mapping[int, float] | None = None
) -> str:
    """Every layer kind by policy: bytes saved and held, the replay's transient, FLOPs (and the replay's predicted
    time on ``device``); then the uniform policies' peaks (and step times), offload's where ``offload`` prices it
    (``Profile.cost_table``)."""
    w = profile.workload
    out = [
        f"{profile.model} ({profile.class_name}): b={w['micro_batch']} s={w['seq_len']} "
        f"{step_dtype(w['dtype'], w.get('precision'))} on "
        f"{w['device']}, {w['attention']} attention; profile {profile.key}, {profile.seconds:.1f} s",
    ]
    for kind in profile.kinds:
        rows = [
            [
                name,
                size(kind.kept[name]),
                size(kind.held[name]),
                size(kind.replay_transient(name)),
                _flops(kind.recompute_flops(name)),
                f"{kind.recompute_flops(name) / max(1, kind.forward_flops + kind.backward_flops['none']):.1%}",
                *([seconds(kind.recompute_seconds(name, device))] if device else []),
            ]
            for name in kind.policies
        ]
        out += [
            "",
            f"{kind.name}: {len(kind.layers)} layer{'s' if len(kind.layers) != 1 else ''}, "
            f"{kind.parameters:,} parameters each, forward {_flops(kind.forward_flops)}",
            render_table(
                ["policy", "saved", "held", "replay transient", "recompute", "of layer step"]
                + (["replay time"] if device else []),
                rows,
            ),
        ]
        out += [f"  {name}: cannot apply ({why})" for name, why in kind.refused.items()]
    table = profile.cost_table(device, offload=offload)
    uniform = []
    for name in table.options():
        c = table.compose([name] * table.n)
        kept = gib(profile.activations([name] * table.n))
        row = [name, gib(c.peak), c.peak_phase, kept, f"{c.flops / table.model_flops:.1%}"]
        if table.model_seconds is not None and c.seconds is not None:
            step = table.model_seconds + c.seconds
            row += time_cells(Timing("", step, profile.tokens / step, c.seconds / table.model_seconds))
        uniform.append(row)
    timed = ["step time", "tokens/s", "time overhead"] if device else []
    out += [
        "",
        f"whole step, every layer alike ({profile.parameter_count:,} parameters; step {_flops(profile.step_flops)}):",
        render_table(["policy", "peak", "at", "activations", "FLOP overhead", *timed], uniform),
        "",
        *(f"note: {n}" for n in profile.notes),
    ]
    return "\n".join(out)

"""Estimates and plans as text (no heavy imports, so ``recompute estimate`` and ``plan`` start fast)."""

from __future__ import annotations

from collections.abc import Sequence

from recompute.core.analytic.estimate import Estimate
from recompute.core.plan import FrontierPoint, Plan
from recompute.core.profile import Composed, Profile, ProfilePlan
from recompute.core.spec import ModelSpec
from recompute.core.table import gib, render_table, size
from recompute.core.timing import Device, Timing
from recompute.core.workload import Workload

__all__ = [
    "describe_workload",
    "device_note",
    "layer_runs",
    "render_estimate",
    "render_plan",
    "render_profile",
    "render_profile_plan",
    "seconds",
    "time_cells",
]


def device_note(device: Device, wl: Workload | None = None) -> str:
    """One line saying where times are predicted and from what."""
    kind = "calibrated" if device.source.startswith("calibrated") else "datasheet roofline"
    traced = ""
    if wl is not None and wl.device == "cuda" and device.kind != "cpu":
        traced = "; kernels from the fake-tensor trace of the step"
    return f"times: predicted on {device.label} ({kind}; see docs/time.md for what the model ignores){traced}"


def describe_workload(spec: ModelSpec, wl: Workload) -> str:
    """One line naming the model and the step's shape."""
    parallel = f"t={wl.tp}{' +sp' if wl.sp else ''} p={wl.pp}" + (f" m={wl.interleave}" if wl.interleave > 1 else "")
    return (
        f"{spec.name}: b={wl.micro_batch} s={wl.seq_len} {wl.dtype} on {wl.device}, {wl.attention} attention, "
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
        describe_workload(spec, wl),
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


def render_plan(spec: ModelSpec, wl: Workload, plan: Plan, *, points: int = 12) -> str:
    """The chosen plan, its breakdown, a sample of the frontier and the uniform policies."""
    est = plan.estimate
    mode = plan.workload.get("loss", "full")
    chosen = next(p for p in plan.frontier if p.cost == plan.cost and p.peak <= plan.budget and p.loss == mode)
    sample = sorted({*_sample(plan.frontier, points), chosen}, key=lambda p: p.peak)
    over = "time overhead" if plan.timed else "overhead"
    timed = ["step time", "tokens/s"] if plan.timed else []

    def cells(p: FrontierPoint) -> list[str]:
        step = plan.model_cost + p.cost
        return [f"{100 * p.overhead:.1f}%", *([seconds(step), f"{plan.tokens / step:,.0f}"] if plan.timed else [])]

    losses = len({p.loss for p in plan.frontier}) > 1

    def loss(p: FrontierPoint) -> list[str]:
        return [p.loss] if losses else []

    frontier = render_table(
        ["", "peak", over, *timed, *(["loss"] if losses else []), "plan (first pipeline stage)"],
        [["*" if p is chosen else "", gib(p.peak), *cells(p), *loss(p), _counts(p.layers)] for p in sample],
    )
    uniform = render_table(
        ["uniform policy", "peak", over, *timed, "fits"],
        [[n, gib(p.peak), *cells(p), "yes" if p.peak <= plan.budget else "no"] for n, p in plan.uniform.items()],
    )
    return "\n".join(
        [
            describe_workload(spec, wl),
            f"budget {gib(plan.budget)}; cost in {plan.cost_kind}",
            "",
            f"plan: {layer_runs(plan.policy.per_layer(spec.n_layers))}"
            + (f"; {plan.workload['loss']} loss" if losses else ""),
            f"predicted peak {gib(est.peak)} ({est.peak_phase}), recompute {over} {100 * plan.overhead:.1f}%"
            + (f"; traced peak {gib(plan.traced_peak)}" if plan.traced_peak is not None else ""),
            render_table(
                ["component", "bytes"],
                [[k, gib(v)] for k, v in est.activations.items() if v]
                + [["model states", gib(est.states.total)]]
                + ([["host memory (offloaded)", gib(est.host)]] if est.host else []),
            ),
            "",
            f"frontier ({len(plan.frontier)} Pareto-optimal plans; {len(sample)} shown, * = chosen):",
            frontier,
            "",
            uniform,
        ]
    )


def _counts(layers: Sequence[str]) -> str:
    return ", ".join(f"{n} x{layers.count(n)}" for n in dict.fromkeys(layers))


def _sample(points: Sequence[FrontierPoint], n: int) -> list[FrontierPoint]:
    """Up to ``n`` points spread evenly along the frontier, always with both ends."""
    if len(points) <= n:
        return list(points)
    step = (len(points) - 1) / (n - 1)
    return [points[round(i * step)] for i in range(n)]


def _flops(n: float) -> str:
    return f"{n / 1e12:.2f} TF" if abs(n) >= 1e11 else f"{n / 1e9:.2f} GF"


def render_profile(profile: Profile, device: Device | None = None) -> str:
    """Every layer kind by policy: bytes saved and held, the replay's transient, FLOPs (and the replay's predicted
    time on ``device``); then the uniform policies' peaks (and step times)."""
    w = profile.workload
    out = [
        f"{profile.model} ({profile.class_name}): b={w['micro_batch']} s={w['seq_len']} {w['dtype']} on "
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
    uniform = [
        [name, gib(c.peak), c.peak_phase, gib(c.activations), f"{c.overhead(profile.step_flops):.1%}"]
        + (_composed_time(c, profile.tokens) if device else [])
        for name in profile.applicable()
        for c in [profile.compose([name] * profile.n_layers, device)]
    ]
    timed = ["step time", "tokens/s", "time overhead"] if device else []
    out += [
        "",
        f"whole step, every layer alike ({profile.parameter_count:,} parameters; step {_flops(profile.step_flops)}):",
        render_table(["policy", "peak", "at", "activations", "FLOP overhead", *timed], uniform),
        "",
        *(f"note: {n}" for n in profile.notes),
    ]
    return "\n".join(out)


def _composed_time(c: Composed, tokens: int) -> list[str]:
    if c.step_seconds is None or c.time_overhead is None:
        return ["-", "-", "-"]
    return time_cells(Timing("", c.step_seconds, tokens / c.step_seconds, c.time_overhead))


def render_profile_plan(result: ProfilePlan) -> str:
    """The chosen plan from a profile, the uniform policies and the frontier (times when planned on a device)."""
    p, c = result.profile, result.chosen
    timed = ["step time", "tokens/s", "time overhead"] if result.device else []

    def cells(x: Composed) -> list[str]:
        return [f"{x.overhead(p.step_flops):.1%}", *(_composed_time(x, p.tokens) if result.device else [])]

    rows = [[name, gib(u.peak), *cells(u)] for name, u in result.uniform.items()]
    front = [[gib(f.peak), *cells(f), _counts(f.layers)] for f in result.frontier]
    cost = f"recompute {c.overhead(p.step_flops):.1%} of the step's FLOPs"
    if result.device and c.step_seconds is not None and c.time_overhead is not None:
        tokens = p.tokens / c.step_seconds
        cost += f"; step {seconds(c.step_seconds)} ({c.time_overhead:+.1%} time), {tokens:,.0f} tokens/s"
    return "\n".join(
        [
            f"{p.model} ({p.class_name}), budget {gib(result.budget)}: from its profile {p.key} "
            f"(b={p.workload['micro_batch']} s={p.workload['seq_len']} {p.workload['dtype']})",
            f"plan ({'least predicted time' if result.device else 'fewest recomputed FLOPs'}): {layer_runs(c.layers)}",
            f"  peak {gib(c.peak)} ({c.peak_phase}), activations {gib(c.activations)}, {cost}",
            "",
            render_table(["every layer", "peak", "FLOP overhead", *timed], rows),
            "",
            f"frontier (peak vs {'time' if result.device else 'recompute'}):",
            render_table(["peak", "FLOP overhead", *timed, "layers"], front),
            *([device_note(result.device)] if result.device else []),
        ]
    )

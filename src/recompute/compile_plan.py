"""``with_memory_budget``: torch.compile's memory budget beside recompute's per-layer plan, on one step (issue 40).

Under ``torch.compile`` two knobs trade memory for time: recompute's per-layer checkpointing (applied before
compiling, it becomes dynamo's checkpoint regions, which the partitioner recomputes) and
``torch._functorch.config.activation_memory_budget``, with which Inductor's min cut recomputes the ops whose
runtime per byte is least until the saved bytes fall to that fraction of its own plan's. Neither figure is known
before the run: PyTorch shows the budget's effect only on the GPU. This module traces the compiled step on fake
tensors (``recompute.trace.trace_budgets``: one dynamo trace per layer assignment, partitioned under every
budget) for a few assignments of the eager plan's frontier (recompute nothing, the plan itself and cheaper
points between; compiled per block, as many on the chunked loss's own frontier too) and prices each (assignment,
budget):

- **peak**: the eager plan's predicted peak of that assignment with the bytes its eager step saves for the
  backward replaced by those its compiled step saves (both counted once per storage, by the same rule, in the
  same trace), and never under the phases no option changes (the optimizer step, the embedding's backward).
  That is exact where the eager peak holds every saved byte (at the start of the backward, where an
  activation-bound step peaks); where the compiled step's graphs free earlier, it is an upper bound. The
  compiled step's own transient (its fused kernels' intermediates) is taken as the eager step's.
- **time** (Note: [pricing a compiled option]): the eager plan's price of the assignment (its checkpointed
  layers' replay, its loss mode's step), plus what the budget recomputes beyond the same assignment under budget
  1.0: the partitioned graphs' FLOPs above that step's (``graph_flops``: matmuls and attention) at the step's
  predicted FLOP rate, and the bytes the recomputed ops without FLOPs (pointwise) write, unfused, at the device's
  memory bandwidth: an upper bound, as Inductor fuses them into the backward's kernels (PyTorch's own knapsack
  prices them at zero).

Note: [pricing a compiled option] A checkpointed layer's replay is the same computation compiled or eager: its
forward's matmuls and attention again, and its pointwise ops, which Inductor fuses. The eager plan prices it by
its kernels' predicted times. Pricing it instead by the graphs' FLOPs at the step's average rate plus its
pointwise bytes unfused counted its memory-bound work twice, and made the same assignment dearer compiled than
eager. So one replay has one price, the eager plan's, and the budget's own recomputation is added on top (the
eager plan has no price for it). Inductor's fused replay is likely cheaper than either; on a GPU neither is
measured yet.

The option chosen is the cheapest that fits; the advice names the best of each knob alone beside it.

Note: [what the compiled options leave out] The chunked loss takes each chunk's gradients inside the forward
(``torch.autograd.grad`` in ``recompute.chunked_loss``), which dynamo does not put in a graph: compiling the whole
model would break it there, so the whole model's compiled options run the full loss (the eager plan's chunked
points are not traced). Compiled per block (torchtitan's way) the head and loss run eagerly anyway, and the
chunked loss runs beside the compiled blocks: those options are weighed in both loss modes, each chunked one
priced by its own loss mode's eager peak and step time (the chunked loss replays nothing; its step's time over
the full loss's is the eager plan's). Offload runs eagerly too (saved-tensor hooks), and is left out likewise.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recompute.core.costs import CostTable
from recompute.core.errors import require
from recompute.core.plan import loss_frontier, uniform_point
from recompute.core.plan_file import Plan, PlanPoint
from recompute.core.policy import Policy
from recompute.core.progress import Progress, no_progress
from recompute.core.stacks import runs
from recompute.core.table import gib, render_table
from recompute.core.workload import Workload

__all__ = [
    "BUDGETS",
    "CompiledOption",
    "CompiledPlan",
    "fixed_floor",
    "render_compiled_plan",
    "with_memory_budget",
]

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.1)
"""The budgets weighed by default: 1.0 is PyTorch's default (the min cut's own plan), 0.1 keeps a tenth of it."""


@dataclass(frozen=True)
class CompiledOption:
    """One way to run the compiled step: recompute's per-layer policies, its loss mode and the partitioner's
    budget."""

    layers: tuple[str, ...]
    """recompute's policy of each layer (applied before ``torch.compile``)."""
    loss: str
    """``full``, or ``chunked`` (compiled per block only: the loss runs eagerly beside the blocks)."""
    budget: float
    """``activation_memory_budget`` (1.0: PyTorch's default)."""
    saved: int
    """Bytes the compiled step saves for the backward (traced)."""
    eager_saved: int
    """Bytes the eager step of ``layers`` saves for the backward, counted the same way (traced)."""
    eager_peak: float
    """The eager plan's predicted peak of ``layers``."""
    peak: float
    flops: int
    """FLOPs of the partitioned forward and backward graphs."""
    extra_flops: int
    """``flops`` above those of the compiled step that recomputes nothing on the full loss (budget 1.0); per
    block a chunked loss's head is in no graph, and a checkpointed core attention can leave the min cut less to
    recompute, so it can be negative. Not the option's price (``overhead``)."""
    extra_bytes: int
    """Bytes the backward's recomputed ops without FLOPs write (unfused), above that step's."""
    kept: tuple[int, ...]
    """Bytes each layer's ops save in the compiled step."""
    overhead: float
    """The time the option adds over the step's (``seconds`` over it); unpriced in time, the eager plan's FLOP
    overhead of ``layers`` and what the budget recomputes beyond them over the step's FLOPs (Note: [pricing a
    compiled option])."""
    seconds: float | None
    """``overhead`` in seconds of the predicted step, when the plan is priced in time."""
    checked: float | None = None
    """Where the option's peak was checked (not under FSDP; Note: [checking a compiled peak]): the
    eager plan's peak of ``layers`` with the eager step's traced window replaced by the compiled step's, never
    under the phases no option changes. ``peak`` is then the larger of this and the substitution. None: not
    checked."""

    @property
    def checkpoints(self) -> bool:
        """Some layer is checkpointed."""
        return any(o != "none" for o in self.layers)

    @property
    def recomputes(self) -> bool:
        """recompute's policies act: a layer checkpointed, or the loss chunked."""
        return self.checkpoints or self.loss == "chunked"

    def label(self) -> str:
        layers = runs(self.layers) if self.checkpoints else ""
        what = ", ".join(x for x in (layers, "chunked loss" if self.loss == "chunked" else "") if x)
        return f"{what or 'nothing'}; budget {self.budget:g}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layers": list(self.layers)}


@dataclass(frozen=True)
class CompiledPlan:
    """The compiled step's options, the one chosen and why (``with_memory_budget``)."""

    options: tuple[CompiledOption, ...]
    chosen: CompiledOption | None
    """The cheapest option that fits the budget; None where none does."""
    budget: float
    advice: str
    notes: tuple[str, ...]
    per_block: bool = False
    """Each layer compiled on its own, as torchtitan compiles (``with_memory_budget(..., per_block=True)``)."""

    def frontier(self) -> tuple[CompiledOption, ...]:
        """Options nothing else beats on both peak and time."""
        ordered = sorted(self.options, key=lambda o: (o.peak, o.overhead))
        out: list[CompiledOption] = []
        for o in ordered:
            if not out or o.overhead < out[-1].overhead:
                out.append(o)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "chosen": self.chosen.to_dict() if self.chosen is not None else None,
            "options": [o.to_dict() for o in self.options],
            "frontier": [self.options.index(o) for o in self.frontier()],
            "advice": self.advice,
            "notes": list(self.notes),
            "per_block": self.per_block,
        }


def with_memory_budget(
    plan: Plan,
    model: Any,
    wl: Workload,
    *,
    tables: Sequence[CostTable] = (),
    budgets: Sequence[float] = BUDGETS,
    assignments: int = 4,
    per_block: bool = False,
    progress: Progress = no_progress,
) -> tuple[Plan, CompiledPlan]:
    """The compiled step's options around ``plan`` (module docstring), and the plan to run: the cheapest option
    that fits, with its budget (``Plan.memory_budget``) and its figures as the chosen point; where no option fits,
    ``plan`` with what was weighed (``Plan.compiled``).

    Args:
        model: what ``plan`` was made for (a preset's name, a ``ModelSource``).
        wl: the workload planned (no tp or pp; under FSDP the unsharded model's step is traced).
        tables: the cost tables ``plan`` was made from: each loss mode's floor (the peak of the phases no option
            changes, ``CostTable.fixed``) and step time; per block, the chunked loss's options come from its table
            (Note: [what the compiled options leave out]). Without them no floor is taken, and per block the
            full loss alone is weighed.
        budgets: ``activation_memory_budget`` values, each in (0, 1].
        assignments: at most this many layer assignments traced per loss mode (each one dynamo trace).
        per_block: each layer compiled on its own, the rest eager, as torchtitan compiles (Note: [compiled per
            block] in ``recompute.trace._compiled``): the budget is a fraction of each block's saved bytes. The
            head's FLOPs are then in no graph, so the FLOP rate is the plan's own step's (``Plan.model_flops``).

    Raises:
        ConfigError: a workload the compiled trace does not run, or a budget outside (0, 1].
    """
    trace_budgets = importlib.import_module("recompute.trace").trace_budgets  # torch, loaded when weighed
    require(bool(budgets), "give at least one memory budget, e.g. 1.0,0.5", fields=("memory_budget",))
    budgets = tuple(sorted({float(b) for b in budgets}, reverse=True))
    if budgets[0] != 1.0:
        budgets = (1.0, *budgets)  # the base every option's time is counted from
    require(
        wl.tp == 1 and wl.pp == 1,
        "the memory budget is weighed on the compiled step of one whole model; drop tp and pp (fsdp is taken)",
        fields=("memory_budget",),
    )
    points, skipped = _assignments(plan, assignments, tables if per_block else ())
    sharded = wl.fsdp
    if wl.fsdp:  # an FSDP rank saves what the unsharded model's step saves: its weights are graph inputs either way
        skipped.append(
            "FSDP: the compiled step traced is the unsharded model's on one rank, whose saved activations are an "
            "FSDP rank's (weights are not saved values: FSDP frees the gathered ones); the sharded states are the "
            "eager plan's"
        )
        wl = dataclasses.replace(wl, fsdp=False, dp=1)
    floors = {str(t.workload["loss"]): fixed_floor(tables, str(t.workload["loss"])) for t in tables}
    options: list[CompiledOption] = []
    eager_layers: dict[str, None] = {}
    base: Any = None
    bandwidth = _bandwidth(plan)
    for i, point in enumerate(points):
        progress("the compiled step, traced under each memory budget", i, len(points))
        step = _step(wl, point.loss, tables)
        traced = trace_budgets(model, step, _policy(point.layers), budgets, eager=True, per_block=per_block)
        base = base or traced[0]  # the first assignment recomputes nothing, under budget 1.0, on the full loss
        own = traced[0]  # this assignment under budget 1.0: what the budget recomputes is counted from it
        step_flops = plan.model_flops if per_block else base.flops  # per block the head is in no graph
        for t in traced:
            if t.eager_note:
                eager_layers[t.eager_note] = None
            assert t.budget is not None and t.eager_saved is not None
            flops, written = t.flops - own.flops, t.recomputed_bytes - own.recomputed_bytes
            seconds = None
            if plan.timed:  # Note: [pricing a compiled option]
                seconds = point.cost + flops * plan.model_cost / step_flops + (written / bandwidth if bandwidth else 0)
            overhead = seconds / plan.model_cost if seconds is not None else point.overhead + flops / plan.model_cost
            options.append(
                CompiledOption(
                    layers=point.layers,
                    loss=point.loss,
                    budget=t.budget,
                    saved=t.saved,
                    eager_saved=t.eager_saved,
                    eager_peak=point.peak,
                    peak=max(floors.get(point.loss, 0.0), point.peak - t.eager_saved + t.saved),
                    flops=t.flops,
                    extra_flops=t.flops - base.flops,
                    extra_bytes=t.recomputed_bytes - base.recomputed_bytes,
                    kept=t.layers,
                    overhead=overhead,
                    seconds=seconds,
                )
            )
    progress("the compiled step, traced under each memory budget", len(points), len(points))
    checks: list[str] = []
    if sharded:
        checks.append(
            "compiled peaks not checked under FSDP (Note: [checking a compiled peak]): the traced step is the "
            "unsharded model's, which holds every gradient through its backward, as an FSDP rank does not"
        )
    else:  # Note: [checking a compiled peak]
        options, checks = _checked(options, plan.budget, model, wl, tables, floors, progress, per_block)
    fitting = [o for o in options if o.peak <= plan.budget]
    chosen = min(fitting, key=_preferred) if fitting else None
    if chosen is not None and chosen.checked is None and any(o.checked is not None for o in options):
        checks.append(f"the option chosen ({chosen.label()}) is unchecked: {CHECKS} cheaper ones were, and did not fit")
    how = "each layer compiled on its own, the rest eager, as torchtitan compiles" if per_block else "the whole model"
    notes = [
        f"compiled options ({how}): the eager plan's peak of each assignment with its eager saved bytes replaced by "
        "the compiled step's (traced on fake tensors, Inductor's min cut); time: the eager plan's price of the "
        "assignment (its checkpointed layers' replay and its loss mode), plus what the memory budget recomputes "
        "beyond the same assignment under budget 1.0: the partitioned graphs' FLOPs at the step's predicted FLOP "
        "rate, and the bytes its recomputed pointwise ops write, unfused, at the device's memory bandwidth "
        "(Inductor fuses them: an upper bound)",
        *checks,
        *skipped,
        *eager_layers,
    ]
    advice = _advice(options, chosen, plan)
    result = CompiledPlan(tuple(options), chosen, plan.budget, advice, tuple(notes), per_block)
    if chosen is None:  # the eager plan stands, with what was weighed
        return dataclasses.replace(plan, compiled=result.to_dict(), notes=(*plan.notes, advice)), result
    return _as_plan(plan, chosen, result, _step(wl, chosen.loss, tables)), result


CHECKS = 3
"""At most this many options' peaks are checked by a trace of their own (not under FSDP), the cheapest that fit
first (Note: [checking a compiled peak])."""


def _preferred(o: CompiledOption) -> tuple[float, float, bool]:
    """The order options are chosen in: the cheapest, then the larger budget, then recompute's policies not
    acting."""
    return (o.overhead, -o.budget, o.recomputes)


def _checked(
    options: list[CompiledOption],
    budget: float,
    model: Any,
    wl: Workload,
    tables: Sequence[CostTable],
    floors: dict[str, float],
    progress: Progress,
    per_block: bool = False,
) -> tuple[list[CompiledOption], list[str]]:
    """``options`` with the peaks of the cheapest that fit checked, until one still fits (at most ``CHECKS``), and
    the notes saying what was checked.

    Note: [checking a compiled peak] The substitution (the eager peak with the eager saved bytes swapped for the
    compiled ones) keeps the eager step's transients. Where the compiled backward recomputes more than it saves (a
    checkpointed layer under a budget below 1.0), its transients are larger, and the substitution is low: 29.1 % under a
    real Inductor step's peak in one of twelve cases measured (``benchmarks/compiled_peak.py``, docs/compiled.md), so a
    plan that does not fit could be chosen. The traced peak of the compiled step (``CompiledTrace.peak``: the
    partitioned graphs run on fake tensors, Inductor's fused buffers left out) has the compiled backward's structure,
    but not Inductor's scheduler, and is low where that reorders (up to 20.9 %) or where the gradients set the peak
    (about 10 %). Their larger is at or above the real peak in all twelve cases (+1.4 % to +30.2 %). So before an option
    is chosen its compiled step is traced once more under its budget, with the peak: the eager plan's peak of its
    layers, less the eager step's window, plus the compiled step's (both counted alike on the same fake model:
    ``CompiledTrace.eager_window``, ``CompiledTrace.peak``), and its peak becomes the larger of that and the
    substitution. One trace per option checked (a dynamo trace and two fake steps; per block, one block's dynamo trace
    and the same two fake steps), so only the cheapest that fit are checked, until one still fits. Compiled per block
    the traced peak was the real one in all twelve cases measured, and so was the substitution once the fixed phases'
    floor is taken (the eager embedding's backward, where the gradients set the peak at s = 256); the check costs one
    block's trace there and guards what was not measured. Not under FSDP: the step traced is the unsharded model's,
    which holds every gradient through its backward (compiled whole, returns them all at its end), as an FSDP rank,
    reduce-scattering them layer by layer, does not.
    """
    traced_step = importlib.import_module("recompute.trace")
    if not traced_step.traces_compiled_peaks():
        return options, [
            "compiled peaks not checked: this PyTorch's dynamo runs no compiled code under a dispatch mode (2.8 and "
            "newer do); the peaks are the substitution alone"
        ]
    out = list(options)
    checked: list[str] = []
    for n in range(CHECKS):
        fitting = [o for o in out if o.peak <= budget and o.checked is None]
        if not fitting:
            break
        o = min(fitting, key=_preferred)
        progress("the cheapest options' compiled peaks, checked", n, CHECKS)
        step = _step(wl, o.loss, tables)
        t = traced_step.trace_budgets(
            model, step, _policy(o.layers), (o.budget,), eager=True, peak=True, per_block=per_block
        )[0]
        assert t.peak is not None and t.eager_window is not None
        traced = max(floors.get(o.loss, 0.0), o.eager_peak - t.eager_window + t.peak)
        done = dataclasses.replace(o, checked=traced, peak=max(o.peak, traced))
        out[out.index(o)] = done
        checked.append(f"{done.label()}: substituted {gib(o.peak)}, traced {gib(traced)}")
        if done.peak <= budget:
            break
    if not checked:
        return out, []
    progress("the cheapest options' compiled peaks, checked", len(checked), len(checked))
    return out, [
        "compiled peaks checked by a trace of their own (Note: [checking a compiled peak] in "
        "src/recompute/compile_plan.py), each option's peak the larger of its substituted and traced figures: "
        + "; ".join(checked)
    ]


def fixed_floor(tables: Sequence[CostTable], loss: str = "full") -> float:
    """The peak of the phases no option changes (the optimizer step, the embedding's backward) of ``loss``'s
    step (the whole model's compiled options run the full loss: Note: [what the compiled options leave out])."""
    return max((v for t in tables if t.workload["loss"] == loss for v in t.fixed.values()), default=0.0)


def _step(wl: Workload, loss: str, tables: Sequence[CostTable]) -> Workload:
    """The step a compiled option of ``loss`` runs: the chunked loss at its table's chunk, else the full loss."""
    if loss != "chunked":
        return dataclasses.replace(wl, loss="full", loss_chunk=None)  # Note: [what the compiled options leave out]
    chunk = next((t.workload.get("loss_chunk") for t in tables if t.workload["loss"] == "chunked"), None)
    return dataclasses.replace(wl, loss="chunked", loss_chunk=chunk)


def render_compiled_plan(r: CompiledPlan) -> str:
    """The options as a table (the chosen one marked, the frontier starred) and the advice."""
    frontier = set(r.frontier())
    rows = []
    for o in sorted(r.options, key=lambda o: (o.peak, o.overhead)):
        mark = ">" if o is r.chosen else ("*" if o in frontier else "")
        cost = f"{o.overhead:+.1%}" + (f" ({o.seconds * 1e3:,.3g} ms)" if o.seconds is not None else "")
        fits = "yes" if o.peak <= r.budget else "no"
        traced = gib(o.checked) if o.checked is not None else ""
        rows.append([mark, o.label(), gib(o.saved), gib(o.peak), traced, cost, fits])
    header = ["", "recompute; memory budget", "saved (compiled)", "peak", "traced (checked)", "time", "fits"]
    if not any(o.checked is not None for o in r.options):
        header, rows = header[:4] + header[5:], [row[:4] + row[5:] for row in rows]
    table = render_table(header, rows)
    return "\n".join(
        [
            f"Under torch.compile ({'each layer on its own, ' if r.per_block else ''}Inductor's min cut), budget "
            f"{gib(r.budget)}:",
            "",
            table,
            "",
            r.advice,
        ]
        + [f"- {n}" for n in r.notes]
    )


def _assignments(plan: Plan, most: int, tables: Sequence[CostTable] = ()) -> tuple[list[PlanPoint], list[str]]:
    """Recompute nothing, the plan, and frontier points spread from the plan's to nothing, on the full loss; and
    where ``tables`` hold the chunked loss's (compiled per block), as many on the chunked loss, from its own
    frontier. No offload (Note: [what the compiled options leave out])."""
    none = plan.uniform.get("none")
    require(
        none is not None and none.loss == "full",
        "the memory budget is weighed from the full loss's step: plan without --loss chunked (the chunked loss is "
        "weighed anyway)",
        fields=("memory_budget",),
    )
    assert none is not None
    skipped: list[str] = []
    chunked = [t for t in tables if t.workload["loss"] == "chunked"]
    if plan.chosen.loss == "chunked" and not chunked:
        skipped.append(
            "the eager plan chunks the loss, which runs outside torch.compile's graphs (its chunks' backward is "
            "taken in the forward): these compiled options use the full loss (compiled per block, with the plan's "
            "cost tables, the chunked loss is weighed beside the blocks)"
        )
    if "offload" in plan.chosen.layers:
        skipped.append("the eager plan offloads, which the compiled trace does not count: left out")
    full = [p for p in plan.frontier if p.loss == "full" and p.layers != none.layers]
    out = [none, *_spread(plan, full, most - 1)]
    if chunked:
        nothing = uniform_point(tables, "none", "chunked")
        own = [p for p in loss_frontier(tables, "chunked", host_budget=0.0) if p.layers != nothing.layers]
        out += [nothing, *_spread(plan, own, most - 1)]
    return list(dict.fromkeys(out)), skipped


def _spread(plan: Plan, points: Sequence[PlanPoint], room: int) -> list[PlanPoint]:
    """The plan's chosen point where it is among ``points``, then the smallest, then points spread towards
    recomputing nothing: ``room`` at most, none that offloads."""
    ok = [p for p in points if "offload" not in p.layers]
    chosen = [plan.chosen] if plan.chosen in ok else []
    rest = sorted((p for p in ok if p not in chosen), key=lambda p: p.peak)
    room = max(0, room - len(chosen))
    if rest and room:  # the smallest first, then spread towards recomputing nothing
        step = (len(rest) - 1) / max(1, room - 1) if room > 1 else 0
        chosen += [rest[round(step * k)] for k in range(min(room, len(rest)))]
    return list(dict.fromkeys(chosen))


def _bandwidth(plan: Plan) -> float | None:
    """The device's memory bandwidth (bytes/s) at its largest measured size, or None."""
    curve = ((plan.device or {}).get("bandwidth") or {}).get("memory")
    return float(curve[-1][1]) if curve else None


def _policy(layers: tuple[str, ...]) -> Policy | str:
    return Policy(layers=layers) if any(o != "none" for o in layers) else "none"


def _advice(options: Sequence[CompiledOption], chosen: CompiledOption | None, plan: Plan) -> str:
    """Which to use, against the best of each knob alone and the eager plan."""

    def best(pred: Any) -> CompiledOption | None:
        fit = [o for o in options if pred(o) and o.peak <= plan.budget]
        return min(fit, key=lambda o: (o.overhead, -o.budget)) if fit else None

    knob = best(lambda o: not o.recomputes)
    policies = best(lambda o: o.recomputes and o.budget == 1.0)
    eager = f"eager (no compile), recompute's plan: {plan.overhead:+.1%} by the time model"
    alone = [
        f"the budget alone: {f'{knob.budget:g} ({knob.overhead:+.1%})' if knob else 'nothing fits'}",
        "recompute's policies alone: "
        + (f"{policies.label()} ({policies.overhead:+.1%})" if policies else "nothing fits"),
        eager,
    ]
    if chosen is None:
        smallest = min(options, key=lambda o: o.peak)
        return (
            f"under torch.compile nothing weighed fits {gib(plan.budget)}: the smallest is {smallest.label()} at "
            f"{gib(smallest.peak)}; " + "; ".join(alone[2:])
        )
    if not chosen.recomputes and chosen.budget == 1.0:
        use = "torch.compile as it is (PyTorch's own memory budget, 1.0)"
    elif not chosen.recomputes:
        use = f"torch.compile's memory budget {chosen.budget:g} alone"
    elif chosen.budget == 1.0:
        use = "recompute's policies under torch.compile's default partitioner"
    else:
        use = f"both: recompute's policies and torch.compile's memory budget {chosen.budget:g}"
    return f"use {use} ({chosen.label()}): {chosen.overhead:+.1%}, peak {gib(chosen.peak)}. " + "; ".join(alone)


def _as_plan(plan: Plan, o: CompiledOption, compiled: CompiledPlan, step: Workload) -> Plan:
    """``plan`` with the compiled option as its chosen point, its memory budget and its loss mode."""
    point = PlanPoint(
        peak=o.peak,
        cost=o.seconds if o.seconds is not None else o.overhead * plan.model_cost,
        overhead=o.overhead,
        layers=o.layers,
        loss=o.loss,
        flops=float(o.extra_flops),
        step_seconds=plan.model_cost + o.seconds if o.seconds is not None else None,
    )
    workload = {**plan.workload, "loss": step.loss, "loss_chunk": step.loss_chunk}
    return dataclasses.replace(
        plan,
        layers=o.layers,
        chosen=point,
        workload=workload,
        peak_phase="backward (compiled)",
        held=float(sum(o.kept)),
        kept=tuple(float(k) for k in o.kept),
        memory_budget=o.budget if o.budget < 1.0 else None,
        compiled=compiled.to_dict(),
        notes=(*plan.notes, compiled.advice),
    )

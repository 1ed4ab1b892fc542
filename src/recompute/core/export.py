"""``export``: a plan in the words of a training stack (torchtitan, Megatron-LM, HF transformers, Lightning).

Each stack can say some per-layer assignments and not others (``recompute.core.stacks`` lists them, with the
sources read). ``export`` prices every setting a stack can say with the plan's own cost table
(``CostTable.compose``, in the loss mode the stack runs) and returns the one that says the plan exactly, or else
the cheapest one whose peak fits the plan's budget, or else (nothing fits) the smallest, with how far over
the budget it is. The text it returns is the stack's own file (a TOML section, command-line flags, Python),
its figures and the reasons in comments. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError, require
from recompute.core.plan_file import Plan
from recompute.core.stacks import STACKS, Setting, Stack, runs
from recompute.core.table import gib

__all__ = ["STACKS", "Export", "Priced", "export"]


@dataclass(frozen=True)
class Priced:
    """An assignment of the first pipeline stage's layers in one loss mode, priced by the plan's cost table."""

    layers: tuple[str, ...]
    loss: str
    peak: float
    peak_phase: str
    cost: float
    """In the table's unit, counted as the plan's are: against the step of the workload's own loss mode."""
    overhead: float
    step_seconds: float | None

    def same_figures(self, other: Priced) -> bool:
        """Equal peak and cost (to rounding): the cost table cannot tell the two apart."""
        return math.isclose(self.peak, other.peak, rel_tol=1e-9) and math.isclose(
            self.cost, other.cost, rel_tol=1e-9, abs_tol=1e-12
        )


@dataclass(frozen=True)
class Export:
    """The setting of a stack that says a plan (``exact``) or comes closest, with what it costs."""

    stack: str
    source: str
    """The release of the stack whose code the vocabulary was read from."""
    setting: Setting
    priced: Priced
    plan: Priced
    """The plan's own figures, for comparison."""
    budget: float
    exact: bool
    """The stack runs the plan's assignment in the plan's loss mode."""
    weighed: int
    """Settings of the stack priced (the closest is the cheapest that fits among them)."""
    why: tuple[str, ...]
    """Why the stack cannot say the plan (empty when ``exact``)."""
    notes: tuple[str, ...]
    text: str
    """The stack's file: the setting in its own format, the figures and reasons in comments."""
    suffix: str
    """The file's extension (``toml``, ``args``, ``py``)."""

    @property
    def fits(self) -> bool:
        return self.priced.peak <= self.budget

    @property
    def equivalent(self) -> bool:
        """Exact, or another assignment with the plan's peak and cost by the cost table."""
        return self.exact or (self.priced.loss == self.plan.loss and self.priced.same_figures(self.plan))

    def to_dict(self) -> dict[str, Any]:
        def priced(p: Priced) -> dict[str, Any]:
            return {
                "layers": list(p.layers),
                "loss": p.loss,
                "peak": p.peak,
                "peak_phase": p.peak_phase,
                "cost": p.cost,
                "overhead": p.overhead,
                "step_seconds": p.step_seconds,
            }

        return {
            "stack": self.stack,
            "source": self.source,
            "exact": self.exact,
            "equivalent": self.equivalent,
            "setting": {"label": self.setting.label, "values": self.setting.values},
            "predicted": priced(self.priced),
            "plan": priced(self.plan),
            "budget": self.budget,
            "fits": self.fits,
            "over_budget": max(0.0, self.priced.peak - self.budget),
            "weighed": self.weighed,
            "why": list(self.why),
            "notes": list(self.notes),
            "text": self.text,
        }


def export(plan: Plan, tables: CostTable | Sequence[CostTable], stack: str, *, plan_file: str = "plan.json") -> Export:
    """``plan`` in ``stack``'s words: exact where it can say it, else its closest setting, priced.

    Args:
        tables: the cost tables the plan was made from (``recompute.core.plan.plan``'s), the workload's own
            loss mode first: every setting is priced by the table of the loss mode the stack runs.
        stack: one of ``STACKS``.
        plan_file: where the plan file is, for the line that applies the plan exactly.

    Raises:
        ConfigError: an unknown stack, or no table in the loss mode the stack runs.
    """
    require(stack in STACKS, f"export to one of {', '.join(STACKS)}; got {stack!r}", fields=("export",))
    kind = STACKS[stack]
    tables = (tables,) if isinstance(tables, CostTable) else tuple(tables)
    table = _table(tables, kind)
    base = tables[0]
    own = Priced(
        plan.chosen.layers,
        plan.loss,
        plan.peak,
        plan.peak_phase,
        plan.cost,
        plan.overhead,
        plan.chosen.step_seconds,
    )
    priced = [(s, p) for s in kind.settings(table) for p in [_price(table, base, s.layers)] if p is not None]
    exact = next(((s, p) for s, p in priced if p.layers == own.layers and p.loss == own.loss), None)
    setting, chosen = exact or _closest(priced, plan.budget)
    placed = any(p.layers == own.layers for _, p in priced)
    why = () if exact else tuple(kind.why_not(own.layers, own.loss, placed))
    out = Export(
        stack=stack,
        source=kind.source,
        setting=setting,
        priced=chosen,
        plan=own,
        budget=plan.budget,
        exact=exact is not None,
        weighed=len(priced),
        why=why,
        notes=tuple(kind.notes(table)),
        text="",
        suffix=kind.suffix,
    )
    if plan.memory_budget is not None:
        out = _with_memory_budget(out, plan.memory_budget, plan.compiled or {}, plan.model_cost)
    header = _header(plan, out, kind, plan_file)
    body = _budget_body(plan.memory_budget) if out.setting.values.get("mode") == "memory_budget" else None
    return replace(out, text="\n".join([*header, *(body or kind.body(setting, table))]) + "\n")


def _with_memory_budget(out: Export, budget: float, compiled: dict[str, Any], model_cost: float) -> Export:
    """A plan run under ``torch.compile``'s memory budget (``recompute plan --memory-budget``): torchtitan's
    ``memory_budget`` mode says it where no layer is checkpointed (its modes exclude each other); no other stack
    has the setting. ``compiled``: the options the plan weighed (``Plan.compiled``; ``per_block``: each layer
    compiled on its own, as torchtitan compiles). With the chunked loss the mode is the closest setting, priced
    by the option of the full loss under the same budget, where the plan weighed one."""
    own = out.plan
    per_block = bool(compiled.get("per_block"))
    full = own if own.loss == "full" else _full_loss_option(compiled, budget, own, model_cost)
    if out.stack == "torchtitan" and set(own.layers) == {"none"} and full is None:
        why = f"the plan weighed no full-loss option under memory_budget {budget:g} to price its memory_budget mode"
        return replace(out, exact=False, why=(*out.why, why))
    if out.stack == "torchtitan" and set(own.layers) == {"none"} and full is not None:
        values = {"mode": "memory_budget", "memory_budget": budget}
        setting = Setting(f'mode = "memory_budget", memory_budget = {budget:g}', values, own.layers)
        notes = out.notes
        if not per_block:
            notes = (
                *notes,
                "the budget's figures are the whole model compiled at once; torchtitan compiles each block on its "
                "own, the head and loss eager, where the budget is a fraction of each block's: plan with "
                "--memory-budget ... --per-block for its figures (docs/compiled.md)",
            )
        exact = own.loss == "full"  # else the budget is said, and the chunked loss is why it is not the plan
        return replace(out, setting=setting, priced=full, exact=exact, why=() if exact else out.why, notes=notes)
    if out.stack == "torchtitan":
        why = "its activation-checkpoint modes exclude each other: memory_budget goes with no per-layer checkpointing"
    else:
        why = f"it has no setting for torch.compile's activation_memory_budget {budget:g}"
    return replace(out, exact=False, why=(*out.why, why))


def _full_loss_option(compiled: dict[str, Any], budget: float, own: Priced, model_cost: float) -> Priced | None:
    """The compiled option the plan weighed with ``own``'s layers on the full loss under ``budget``, or None."""
    for o in compiled.get("options", ()):
        if o["loss"] == "full" and o["budget"] == budget and tuple(o["layers"]) == own.layers:
            cost = o["seconds"] if o["seconds"] is not None else o["overhead"] * model_cost
            step = model_cost + cost if own.step_seconds is not None else None
            return Priced(own.layers, "full", o["peak"], "backward (compiled)", cost, o["overhead"], step)
    return None


def _budget_body(budget: float | None) -> list[str]:
    """torchtitan's ``[activation_checkpoint]`` in ``memory_budget`` mode (``ActivationCheckpoint.memory_budget``,
    a float); the mode asserts the model is compiled."""
    return [
        "[activation_checkpoint]",
        'mode = "memory_budget"',
        f"memory_budget = {budget}",
        "",
        "[compile]  # memory_budget mode needs the model compiled (torchtitan asserts it)",
        "enable = true",
    ]


def _table(tables: Sequence[CostTable], kind: Stack) -> CostTable:
    """The table of the loss mode the stack runs (the full loss: none of them has recompute's chunked loss)."""
    found = next((t for t in tables if t.workload["loss"] == kind.loss), None)
    if found is None:
        raise ConfigError(
            f"--export {kind.name} prices its settings with the {kind.loss} loss ({kind.name} has no chunked loss), "
            "but the plan has no cost table for it: plan without --loss chunked (the chunked loss is weighed anyway)",
            fields=("export",),
        )
    return found


def _price(table: CostTable, base: CostTable, layers: tuple[str, ...]) -> Priced | None:
    """The assignment's figures as the planner counts a plan's (``recompute.core.plan``), or None where a layer
    cannot take its option (the setting does not apply to this model)."""
    try:
        c = table.compose(layers)
    except ConfigError:
        return None
    extra = table.model_cost - base.model_cost if table.timed else 0.0
    cost = table.cost(c) + extra
    step = table.model_seconds + table.cost(c) if table.model_seconds is not None else None
    overhead = cost / base.model_cost if base.model_cost else 0.0
    return Priced(tuple(layers), str(table.workload["loss"]), c.peak, c.peak_phase, cost, overhead, step)


def _closest(priced: Sequence[tuple[Setting, Priced]], budget: float) -> tuple[Setting, Priced]:
    """The cheapest setting that fits; when none does, the smallest."""
    fits = [sp for sp in priced if sp[1].peak <= budget]
    if fits:
        return min(fits, key=lambda sp: (sp[1].cost, sp[1].peak))
    return min(priced, key=lambda sp: (sp[1].peak, sp[1].cost))


def _cost(p: Priced, plan: Plan) -> str:
    if p.step_seconds is not None:
        return f"{p.overhead:+.1%} time (step {p.step_seconds * 1e3:,.1f} ms)"
    if plan.cost_kind == "FLOPs":
        return f"{p.overhead:.1%} of the step's FLOPs replayed"
    return f"{p.overhead:+.1%} ({plan.cost_kind})"


def _fit(p: Priced, budget: float) -> str:
    if p.peak <= budget:
        return f"peak {gib(p.peak)} of the {gib(budget)} budget (fits, {gib(budget - p.peak)} to spare)"
    return f"peak {gib(p.peak)}: {gib(p.peak - budget)} OVER the {gib(budget)} budget"


def _stage(plan: Plan) -> str:
    pp = int(plan.workload.get("pp", 1) or 1)
    return f" (the first of {pp} pipeline stages, each alike)" if pp > 1 else ""


def _header(plan: Plan, out: Export, kind: Stack, plan_file: str) -> list[str]:
    """The comment lines: the plan, whether the stack says it, the setting's figures, the exact alternative."""
    w = plan.workload
    loss = "; chunked loss" if plan.loss == "chunked" else ""
    lines = [
        f"recompute plan of {plan.model} (b={w['micro_batch']} s={w['seq_len']}), budget {gib(plan.budget)}, "
        f"costs in {plan.cost_kind}",
        f"plan{_stage(plan)}: {runs(out.plan.layers)}{loss}: peak {gib(out.plan.peak)}, {_cost(out.plan, plan)}",
    ]
    if out.exact:
        lines.append(f"{kind.name} ({kind.source}): exact, the plan as it is")
    else:
        lines += [
            f"{kind.name} ({kind.source}) cannot express the plan: " + "; ".join(out.why),
            f"closest of the {out.weighed} settings it can express, priced by the plan's cost table"
            + (" (the same peak and cost as the plan)" if out.equivalent else "")
            + ("" if out.fits else "; none fits the budget, this is the smallest")
            + ":",
            f"  {out.setting.label}: {runs(out.priced.layers)}",
            f"  {_fit(out.priced, plan.budget)}; {_cost(out.priced, plan)}",
        ]
    lines += kind.exact(plan_file, plan.loss == "chunked", plan.memory_budget)
    lines += [f"note: {n}" for n in out.notes]
    return [f"# {line}" for line in lines]

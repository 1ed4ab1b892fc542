"""``plan``: the cheapest per-layer plan whose peak fits a memory budget, its frontier, and the plan file.

One planner for every model source. A model becomes one ``CostTable`` per loss mode (a preset's from the
analytic model, any other model's from its measured profile); ``recompute.core.search`` finds each table's
exact Pareto frontier of (peak, cost); the loss mode is a global choice on top: each mode's step costs its
own (a predicted step time, or in FLOPs nothing, as the chunked loss replays nothing), the cheapest plan that
fits wins and, at equal cost, the workload's own mode (another changes the training loop). Offload is an
option per layer where the table prices it; a host budget caps the host bytes of the offloaded layers. With
``traced_peak`` the chosen plan is checked by the real step's peak (``recompute.trace``; on CUDA what the caching
allocator reserves over its steps, replayed from the trace) and replaced by the
next cheaper one while it is over. When nothing fits, the message gives the smallest achievable peak and the
least invasive workload change that would fit (``recompute.core.advice``). The result and the file it writes
are ``recompute.core.plan_file``'s. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from recompute.core.advice import ALTERNATIVE_FIELDS, NothingFits, nothing_fits
from recompute.core.analytic.estimate import Estimate, estimate
from recompute.core.costs import Composed, CostTable
from recompute.core.errors import ConfigError, require
from recompute.core.identity import ModelId
from recompute.core.plan_file import FORMAT, Plan, PlanPoint, Traced, parse_budget
from recompute.core.policy import POLICIES, Policy
from recompute.core.search import search, smallest_peak
from recompute.core.spec import ModelSpec
from recompute.core.table import gib
from recompute.core.workload import Workload, build_workload

__all__ = [
    "ALTERNATIVE_FIELDS",
    "FORMAT",
    "NothingFits",
    "Plan",
    "PlanPoint",
    "Traced",
    "best_uniform",
    "frontier",
    "loss_frontier",
    "parse_budget",
    "plan",
    "require_fits",
    "smallest_achievable",
    "uniform_point",
]


def plan(
    tables: CostTable | Sequence[CostTable],
    budget: float,
    *,
    host_budget: float | None = None,
    traced_peak: Callable[[Policy, Workload], float | Traced] | None = None,
    alternatives: Callable[[Workload], float | None] | None = None,
    notes: Sequence[str] = (),
) -> Plan:
    """The least-cost plan whose peak is at most ``budget`` bytes.

    Args:
        tables: the model's cost table in each loss mode to choose from, the workload's own mode first.
        host_budget: host-memory bytes per rank that offloaded layers may take; None: unchecked.
        traced_peak: the peak of a policy's real step at a workload, e.g. ``recompute.trace``'s on fake tensors
            (``plan --trace``), or a ``Traced`` with what the CUDA caching allocator reserves over its steps,
            which is then what must fit: while the chosen plan's is over the budget, the next cheaper plan under
            a budget lowered by the overshoot is traced in turn.
        alternatives: the smallest achievable peak of the model at another workload (None where it is not known
            without measuring): the advice when nothing fits.

    Raises:
        ConfigError: nothing fits; the message gives the smallest achievable peak and what would fit.
    """
    tables = _as_tables(tables)
    points = frontier(tables, host_budget=host_budget)
    own = [p for p in points if p.loss == tables[0].workload["loss"]] or _own_frontier(tables[0], host_budget)
    chosen = _choose(points, own, budget)
    if chosen is None:
        raise NothingFits(_nothing_fits(tables, budget, points, alternatives, host_budget))
    traced: Traced | None = None
    if traced_peak is not None:
        chosen, traced = _fit_traced(tables, (points, own), chosen, budget, traced_peak)
    if chosen not in points:  # the workload's own loss mode, at the cost of a point of another's
        points = sorted([*points, chosen], key=lambda p: (p.peak, p.cost))
    table = _table_of(tables, chosen.loss)
    composed = table.compose(chosen.layers)
    base = tables[0]
    return Plan(
        model=base.model,
        workload=table.workload,
        budget=budget,
        layers=table.whole_model(chosen.layers),
        chosen=chosen,
        peak_phase=composed.peak_phase,
        held=composed.held,
        kept=tuple(table.kind_of(i).kept[o] for i, o in enumerate(chosen.layers)),
        cost_kind=base.cost_kind,
        model_cost=base.model_cost,
        model_flops=base.model_flops,
        tokens=base.tokens,
        frontier=tuple(points),
        uniform={o: _point(base, base.compose((o,) * base.n), tables) for o in base.options()},
        host_budget=host_budget,
        traced_peak=traced.peak if traced is not None else None,
        traced_reserved=traced.reserved if traced is not None else None,
        device=base.device,
        source=base.source,
        notes=tuple(notes) + table.notes,
        model_hash=base.model_hash,
    )


def frontier(tables: CostTable | Sequence[CostTable], *, host_budget: float | None = None) -> list[PlanPoint]:
    """The Pareto frontier of predicted peak vs cost over every loss mode's table, smallest peak first."""
    tables = _as_tables(tables)
    found = [_point(t, c, tables) for t in tables for c in search(t, host_budget=host_budget).frontier]
    return _pareto(found)


def loss_frontier(
    tables: CostTable | Sequence[CostTable], loss: str, *, host_budget: float | None = None
) -> list[PlanPoint]:
    """One loss mode's own frontier, smallest peak first, each point's cost counted as ``frontier`` counts it
    (against the first table's step)."""
    tables = _as_tables(tables)
    table = _table_of(tables, loss)
    return [_point(table, c, tables) for c in search(table, host_budget=host_budget).frontier]


def uniform_point(tables: CostTable | Sequence[CostTable], option: str, loss: str) -> PlanPoint:
    """``option`` on every layer under ``loss``'s table, its cost counted as ``frontier`` counts it."""
    tables = _as_tables(tables)
    table = _table_of(tables, loss)
    return _point(table, table.compose((option,) * table.n), tables)


def smallest_achievable(tables: CostTable | Sequence[CostTable], *, host_budget: float | None = None) -> float:
    """The smallest peak any plan of the model reaches, over its loss modes (exact; no costs)."""
    return min(smallest_peak(t, host_budget=host_budget) for t in _as_tables(tables))


def require_fits(
    tables: CostTable | Sequence[CostTable],
    budget: float,
    *,
    host_budget: float | None = None,
    alternatives: Callable[[Workload], float | None] | None = None,
) -> None:
    """Check that some plan fits ``budget`` before anything is spent pricing plans (peaks depend on no cost).

    Raises:
        ConfigError: nothing fits; the message gives the smallest achievable peak and what would fit.
    """
    tables = _as_tables(tables)
    smallest = smallest_achievable(tables, host_budget=host_budget)
    if smallest > budget:
        raise NothingFits(nothing_fits(tables[0], budget, smallest, alternatives))


def _as_tables(tables: CostTable | Sequence[CostTable]) -> tuple[CostTable, ...]:
    out = (tables,) if isinstance(tables, CostTable) else tuple(tables)
    require(len(out) > 0, "plan needs at least one cost table")
    require(
        len({t.timed for t in out}) == 1 and len({t.model for t in out}) == 1,
        "the cost tables of one plan must be of one model and priced in one unit",
    )
    return out


def _table_of(tables: Sequence[CostTable], loss: str) -> CostTable:
    return next(t for t in tables if t.workload["loss"] == loss)


ORDER = ("offload", *reversed(POLICIES))
"""How a plan of alike layers is written, bottom up, where the order does not change its peak: offloaded layers
first (their copies have the longest to hide), then the most recomputing (as Megatron's block method)."""


def _canonical(table: CostTable, c: Composed) -> Composed:
    """``c`` in ``ORDER`` when its layers are alike and that order peaks no higher (the search keeps one of the
    orders of equal peak, not always this one)."""
    if len(table.kinds) > 1:
        return c
    ordered = tuple(sorted(c.layers, key=lambda o: ORDER.index(o) if o in ORDER else len(ORDER)))
    if ordered == c.layers:
        return c
    other = table.compose(ordered)
    return other if other.peak <= c.peak * (1 + 1e-12) else c


def _point(table: CostTable, c: Composed, tables: Sequence[CostTable]) -> PlanPoint:
    """A composed assignment as a frontier point, its cost counted against the first table's step: a loss mode
    costs its own step's time over the first mode's (in FLOPs, nothing: the chunked loss replays nothing)."""
    c = _canonical(table, c)
    base = tables[0]
    extra = table.model_cost - base.model_cost if table.timed else 0.0
    cost = table.cost(c) + extra
    step = table.model_seconds + table.cost(c) if table.model_seconds is not None else None
    return PlanPoint(
        peak=c.peak,
        cost=cost,
        overhead=cost / base.model_cost if base.model_cost else 0.0,
        layers=c.layers,
        loss=str(table.workload["loss"]),
        flops=c.flops,
        step_seconds=step,
        host=c.host,
    )


def _own_frontier(table: CostTable, host_budget: float | None) -> list[PlanPoint]:
    return [_point(table, c, (table,)) for c in search(table, host_budget=host_budget).frontier]


def _pareto(points: Sequence[PlanPoint]) -> list[PlanPoint]:
    """The points nothing else is both smaller and cheaper than, smallest peak first."""
    best: list[PlanPoint] = []
    for p in sorted(points, key=lambda p: (p.peak, p.cost)):
        if not best or p.cost < best[-1].cost:
            best.append(p)
    return best


def _fitting(points: Sequence[PlanPoint], budget: float) -> PlanPoint | None:
    fits = [p for p in points if p.peak <= budget]
    return min(fits, key=lambda p: (p.cost, p.peak)) if fits else None


def _choose(points: Sequence[PlanPoint], own: Sequence[PlanPoint], budget: float) -> PlanPoint | None:
    """The cheapest point that fits; at equal cost one of ``own``, the workload's loss mode."""
    chosen, kept = _fitting(points, budget), _fitting(own, budget)
    return kept if kept is not None and chosen is not None and kept.cost <= chosen.cost else chosen


def _fit_traced(
    tables: Sequence[CostTable],
    fronts: tuple[Sequence[PlanPoint], Sequence[PlanPoint]],
    chosen: PlanPoint,
    budget: float,
    traced_peak: Callable[[Policy, Workload], float | Traced],
) -> tuple[PlanPoint, Traced]:
    """The cheapest frontier point whose traced step fits ``budget`` (its reserve where known), and that step.

    Each round traces the candidate in its loss mode; an overshoot lowers the target by that much (the
    predicted error is nearly the same for neighbouring plans), and the next candidate is traced in turn.
    """
    points, own = fronts
    target, reserved = budget, False
    for _ in range(len(points) + len(own)):
        table = _table_of(tables, chosen.loss)
        policy = Policy(layers=table.whole_model(chosen.layers), model=ModelId(table.model, table.model_hash))
        got = traced_peak(policy, build_workload(**table.workload))
        traced = got if isinstance(got, Traced) else Traced(float(got))
        if traced.needs <= budget:
            return chosen, traced
        reserved |= traced.reserved is not None
        target -= max(traced.needs - budget, 1.0)
        lower = _choose(points, own, target)
        if lower is None:
            break
        chosen = lower
    what = "what CUDA's caching allocator reserves for" if reserved else "peak of"
    raise ConfigError(
        f"no plan fits {gib(budget)} by {what} its traced step (the smallest predicted peak is "
        f"{gib(points[0].peak)}); raise the budget or see the fixes without trace",
        fields=("trace",),
    )


def _nothing_fits(
    tables: Sequence[CostTable],
    budget: float,
    points: Sequence[PlanPoint],
    alternatives: Callable[[Workload], float | None] | None,
    host_budget: float | None,
) -> str:
    smallest = points[0].peak if points else smallest_achievable(tables, host_budget=host_budget)
    return nothing_fits(tables[0], budget, smallest, alternatives)


def best_uniform(
    spec: ModelSpec, wl: Workload, budget: float, *, names: Sequence[str] = ("block",)
) -> tuple[Policy, Estimate] | None:
    """The cheapest 'recompute every k-th layer' setting of a preset that fits, or None: the baseline a plan is
    compared with.

    With the default ``names=("block",)`` this is what HF (``every_n_layers``) and torchtitan's former
    selective-layer option offer; pass ``POLICIES`` to search every policy on every k-th layer.
    """
    best: tuple[Policy, Estimate] | None = None
    for name in names:
        for every in range(1, spec.n_layers + 1):
            pol = Policy(name, every=every)
            est = estimate(spec, wl, pol)
            if est.peak <= budget and (best is None or est.recompute_flops < best[1].recompute_flops):
                best = (pol, est)
    return best

"""Plan: the cheapest per-layer recomputation whose predicted peak fits a memory budget, and the frontier.

The layers of a model form a chain, and the analytic peak of a chain (``analytic.estimate``) is the larger of

- the loss phase: k * S + E + H + loss, with S the bytes stored by the first stage's layers for one
  micro-batch, k the micro-batches in flight, E the embedding, H the head and logits;
- the backward of the top layer of the stage: (k - 1) * S + (S - s_top) + A + W + E, because whatever a
  layer's policy, all of its activations exist while its backward runs (stored ones plus the recomputed
  transient add up to A, what ``none`` stores), and this phase only grows towards the top of the chain.

So the peak depends only on S and on the top layer's stored bytes s_top. The planner tries each policy for the
top layer and, for the other layers, builds the exact Pareto set of (stored bytes, recompute cost) over the
chain by dynamic programming (a multiple-choice knapsack with no discretisation), then keeps the cheapest
combination that fits. With pipeline parallelism the plan is made for the first stage, the most loaded one,
and repeated on every stage. Torch-free.

The planner searches ``POLICIES`` and, when given its cost, ``offload`` per layer: it keeps nothing on the
device, and costs the copy time to and from host memory that the layer's compute does not hide
(``offload_seconds``; only when costs are seconds, and never on a CPU, whose "host" is its own memory). Under
offload a layer's backward also holds the layer below's tensors being copied back, which the chain's backward
terms add (an upper bound) whenever a plan offloads; a host budget caps how many layers it offloads (their
saved tensors take pinned host memory). The loss mode is a global choice on top: with
``losses=("full", "chunked")`` each mode's frontier is built, the chunked loss costing its own step time (in
FLOPs it costs nothing: it replays nothing), and the cheapest plan of either that fits wins; at equal cost the
workload's own loss mode.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from recompute.core.analytic.estimate import (
    Estimate,
    GradientArrival,
    after_backward,
    estimate,
    gradient_arrival,
    in_flight,
    resident_states,
)
from recompute.core.analytic.flops import layer_flops, model_flops, recompute_flops
from recompute.core.analytic.memory import layer_activations, outer_activations
from recompute.core.analytic.params import model_states
from recompute.core.errors import ConfigError, require
from recompute.core.policy import POLICIES, Policy
from recompute.core.results import read_bench
from recompute.core.spec import ModelSpec
from recompute.core.table import GiB, MiB, gib
from recompute.core.workload import Workload

__all__ = [
    "FrontierPoint",
    "Plan",
    "Times",
    "best_uniform",
    "frontier",
    "offload_seconds",
    "parse_budget",
    "plan",
    "policy_costs",
    "require_fits",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}


def parse_budget(text: str | float, what: str = "budget") -> float:
    """Bytes from ``70GiB``, ``80 GB``, ``7.5e10`` or a number (``what``: the field it is for).

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        require(
            m is not None and unit in _UNITS,
            f"{what} {text!r} is not a size; write e.g. 70GiB or 80GB",
            fields=(what,),
        )
        value = float(m.group(1)) * _UNITS[unit]  # type: ignore[union-attr]
    require(
        0 < value < float("inf"),
        f"{what} must be a positive, finite size, got {text!r}",
        fields=(what,),
    )
    return value


@dataclass(frozen=True)
class FrontierPoint:
    """One Pareto-optimal plan: nothing else is both cheaper and smaller."""

    peak: float
    """Predicted peak bytes per rank."""
    cost: float
    """Recompute cost of the step (FLOPs, or seconds with measured costs)."""
    overhead: float
    """Recompute cost over the step's model cost."""
    layers: tuple[str, ...]
    """The policy of each layer of the first pipeline stage (repeated on every stage)."""
    loss: str = "full"
    """The loss mode (``Workload.loss``) the point is planned with."""


@dataclass(frozen=True)
class Plan:
    """The chosen plan, its prediction, the frontier and the uniform policies for comparison."""

    model: str
    workload: dict[str, Any]
    budget: float
    policy: Policy
    estimate: Estimate
    cost: float
    overhead: float
    cost_kind: str
    frontier: tuple[FrontierPoint, ...]
    uniform: dict[str, FrontierPoint] = field(default_factory=dict)
    traced_peak: float | None = None
    """The chosen plan's peak by ``recompute.trace`` (``plan(..., traced=True)``), else ``None``."""
    model_cost: float = 0.0
    """The step's cost without recomputation, in the unit of ``cost`` (a step time when costs are seconds)."""
    tokens: int = 0
    """Tokens per micro-batch (b x s), for tokens/s when costs are seconds."""

    @property
    def timed(self) -> bool:
        """Costs are seconds (predicted or measured): a point's step time is ``model_cost + cost``."""
        return "seconds" in self.cost_kind

    def to_dict(self) -> dict[str, Any]:
        """The plan file: ``Policy.from_dict`` reads its ``policy`` entry, so ``apply`` takes the file as is."""

        def point(p: FrontierPoint) -> dict[str, Any]:
            out = {"peak": p.peak, "cost": p.cost, "overhead": p.overhead, "layers": list(p.layers), "loss": p.loss}
            if self.timed:
                step = self.model_cost + p.cost
                out |= {"step_seconds": step, "tokens_per_second": self.tokens / step if step else None}
            return out

        return {
            "format": "recompute.plan/1",
            "model": self.model,
            "workload": self.workload,
            "budget": self.budget,
            "cost_kind": self.cost_kind,
            "policy": self.policy.to_dict(),
            "predicted": {
                "peak": self.estimate.peak,
                "peak_phase": self.estimate.peak_phase,
                "activations": self.estimate.activations,
                "overhead": self.overhead,
                "cost": self.cost,
                "model_cost": self.model_cost,
                "traced_peak": self.traced_peak,
                "host": self.estimate.host,
            },
            "frontier": [point(p) for p in self.frontier],
            "uniform": {name: point(p) for name, p in self.uniform.items()},
        }


@dataclass(frozen=True)
class _Chain:
    """Everything the peak of the first stage depends on, per micro-batch."""

    stored: dict[str, float]
    cost: dict[str, float]
    """Per-layer cost of each option the plan may take (``POLICIES``, and ``offload`` when it is priced)."""
    n: int
    """Layers in the first stage."""
    stages: int
    k: float
    states: float
    """Model-state bytes resident all step (``resident_states``)."""
    loss_extra: float
    """E + H + logits + loss transient: added to k * S at the loss."""
    top_extra: float
    """A + W + E + kept logits: added to k * S - s_top in the backward of the top layer."""
    grads: GradientArrival
    after: float
    """The embedding's backward or the optimizer step, whichever is larger (the same for every plan)."""
    model_cost: float
    timed: bool
    """Costs are seconds (measured or predicted), not FLOPs."""
    ahead: float = 0.0
    """An offloaded layer's bytes: copied back while the layer above runs its backward."""
    max_offload: int | None = None
    """The most layers the host budget lets a plan offload (None: no host budget)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.cost)

    def peak(self, S: Any, s_top: float, offloads: bool = False) -> Any:
        """Note: [endpoints suffice] in layer order (offloaded, then most recomputing first) a layer's backward
        holds the stored bytes below it, the whole layer again, and the gradients made above it: stored bytes
        grow and gradients shrink by a constant per layer going up, and stored bytes grow fastest at the top,
        so the largest backward phase is at the top layer or at the bottom one. A plan that ``offloads`` adds
        one layer being copied back to both (at most one is in flight: the bound holds for every layer).
        ``S`` is a number or a numpy array of them."""
        import numpy as np

        ahead = self.ahead if offloads else 0.0
        top = self.k * S - s_top + self.top_extra + self.grads.before(self.n - 1, self.n) + ahead
        bottom = (self.k - 1) * S + self.top_extra + self.grads.before(0, self.n) + ahead
        return self.states + np.maximum(np.maximum(self.k * S + self.loss_extra, top), np.maximum(bottom, self.after))


def policy_costs(
    spec: ModelSpec,
    wl: Workload,
    measured: str | Path | None = None,
    times: Mapping[str, float] | None = None,
) -> tuple[dict[str, float], float]:
    """Per-layer recompute cost of each policy and the model cost of a step, in FLOPs or seconds.

    A measured file is a ``recompute bench --json`` result: its per-policy step times give each policy's
    per-layer cost as (t_policy - t_none) / L. ``times`` are predicted step times of each uniform policy
    (``recompute.core.timing``), used the same way.
    """
    if times is not None:
        missing = [p for p in POLICIES if p not in times]
        require(not missing, f"no predicted step time for {', '.join(missing)}")
        return {p: max(0.0, (times[p] - times["none"]) / spec.n_layers) for p in POLICIES}, times["none"]
    if measured is None:
        lf = layer_flops(spec, wl)
        return {p: lf.recomputed(p) for p in POLICIES}, model_flops(spec, wl)
    times = read_bench(measured, model=spec.name).step_times()
    missing = [p for p in POLICIES if p not in times]
    require(not missing, f"{measured}: no measured step time for {', '.join(missing)}; bench every policy")
    base = times["none"]
    return {p: max(0.0, (times[p] - base) / spec.n_layers) for p in POLICIES}, base


def offload_seconds(layer_bytes: float, forward: float, backward: float, host_link: float) -> float:
    """A layer's offload cost: its saved bytes copied out during the forward and back during the backward over
    the host link, less what one layer's forward (resp. backward) compute hides (the copies run on a side
    stream, prefetched one layer ahead)."""
    copy = layer_bytes / host_link
    return max(0.0, copy - forward) + max(0.0, copy - backward)


def _chain(
    spec: ModelSpec,
    wl: Workload,
    cost: dict[str, float],
    model_cost: float,
    timed: bool,
    offload: float | None = None,
    host_budget: float | None = None,
) -> _Chain:
    la = layer_activations(spec, wl)
    outer = outer_activations(spec, wl, last_stage=wl.pp == 1)
    k = in_flight(wl)
    embedding = k * outer.embedding
    states = model_states(spec, wl)
    options = {**cost, "offload": offload} if offload is not None else dict(cost)
    return _Chain(
        stored={p: la.stored(p) for p in options},
        cost=options,
        n=-(-spec.n_layers // wl.pp),
        stages=wl.pp,
        k=k,
        states=resident_states(wl, states),
        loss_extra=embedding + outer.head + outer.logits + outer.loss_transient,
        top_extra=la.total + la.workspace + embedding + outer.kept_logits,
        grads=gradient_arrival(spec, wl, states),
        after=after_backward(spec, wl, states, embedding + outer.kept_logits)[0],
        model_cost=model_cost,
        timed=timed,
        ahead=la.offloaded("offload"),
        max_offload=_max_offload(k * la.offloaded("offload"), host_budget),
    )


def _max_offload(per_layer: float, host_budget: float | None) -> int | None:
    """Offloaded layers whose host bytes (``per_layer`` each, all micro-batches in flight) fit ``host_budget``."""
    if host_budget is None:
        return None
    return int(host_budget // per_layer) if per_layer > 0 else None


@dataclass(frozen=True)
class _Fronts:
    """Exact Pareto sets of (stored bytes, cost) over 0, 1, ..., n alike layers, each choosing among ``names``.

    Dynamic programming one layer at a time over whole Pareto sets (no memory discretisation, so exact):
    front_n = pareto(front_{n-1} + each option), with back-pointers to recover a point's layers.
    """

    names: tuple[str, ...]
    mem: list[Any]
    """Per length, the stored bytes of its points (numpy arrays)."""
    cost: list[Any]
    steps: list[tuple[Any, Any]]
    """Per layer added: (parent index, option index) of each point of that length."""

    @classmethod
    def of(cls, chain: _Chain, n: int, names: Sequence[str]) -> _Fronts:
        import numpy as np

        om = np.array([chain.stored[p] for p in names])
        oc = np.array([chain.cost[p] for p in names])
        mems, costs, steps = [np.zeros(1)], [np.zeros(1)], []
        for _ in range(n):
            m_all = (mems[-1][:, None] + om[None, :]).ravel()
            c_all = (costs[-1][:, None] + oc[None, :]).ravel()
            order = np.lexsort((c_all, m_all))  # by memory, then cost
            best_before = np.concatenate(([np.inf], np.minimum.accumulate(c_all[order])[:-1]))
            keep = order[c_all[order] < best_before]
            steps.append((keep // len(names), keep % len(names)))
            mems.append(m_all[keep])
            costs.append(c_all[keep])
        return cls(tuple(names), mems, costs, steps)

    def counts(self, length: int, index: int) -> dict[str, int]:
        """Layers per option of point ``index`` of ``length``, by its back-pointers."""
        out = dict.fromkeys(self.names, 0)
        for parents, options in reversed(self.steps[:length]):
            out[self.names[int(options[index])]] += 1
            index = int(parents[index])
        return out


_ORDER = ("offload", *reversed(POLICIES))
"""Layer order of a plan, bottom up: offloaded layers first (their copies have the longest to overlap), then
the most recomputing policies (as Megatron's block method)."""


def _layers(counts: Mapping[str, int], top: str) -> tuple[str, ...]:
    """Layers from counts per option, in ``_ORDER``, then ``top``."""
    return (*(name for name in _ORDER for _ in range(counts.get(name, 0))), top)


def _candidates(chain: _Chain, *, loss: str = "full", extra: float = 0.0, base: float = 0.0) -> list[FrontierPoint]:
    """Every plan on the Pareto frontier of (peak, cost), over all choices of the top layer.

    The cost of a plan is p times that of the first stage, whose pattern every stage repeats, plus ``extra``
    (the loss mode's own cost); overheads are over ``base`` (the model cost of the reference loss mode, else
    the chain's). With offload among the options, each count j of offloaded layers (the bottom ones, at most
    the host budget's) is tried with the recomputing front of the rest, as a plan that offloads carries the
    copied-back layer in its peak: exact, the layers being alike.
    """
    import numpy as np

    without = tuple(n for n in chain.names if n != "offload")
    fronts = _Fronts.of(chain, chain.n - 1, without)
    most = chain.n if chain.max_offload is None else min(chain.n, chain.max_offload)
    offloaded = range(1, most + 1) if "offload" in chain.names else range(0)
    peaks, costs, tags = [], [], []
    for j in (0, *offloaded):
        below = j - (j == chain.n)  # offloaded layers under the top one, which is offloaded only if all are
        length = chain.n - 1 - below
        off_bytes, off_cost = (below * chain.stored["offload"], below * chain.cost["offload"]) if j else (0.0, 0.0)
        for top in ("offload",) if j == chain.n else without:
            S = fronts.mem[length] + off_bytes + chain.stored[top]
            peaks.append(chain.peak(S, chain.stored[top], j > 0))
            costs.append(chain.stages * (fronts.cost[length] + off_cost + chain.cost[top]) + extra)
            tags += [(below, length, i, top) for i in range(len(S))]
    peak, cost = np.concatenate(peaks), np.concatenate(costs)
    order = np.lexsort((cost, peak))  # by peak, then cost
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(cost[order])[:-1]))
    best: list[FrontierPoint] = []
    for i in order[cost[order] < best_before]:
        below, length, index, top = tags[i]
        layers = _layers({**fronts.counts(length, index), "offload": below}, top)
        c = float(cost[i])
        best.append(
            FrontierPoint(
                peak=float(peak[i]), cost=c, overhead=c / (base or chain.model_cost), layers=layers, loss=loss
            )
        )
    return best


def _pareto(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """The points nothing else is both smaller and cheaper than, smallest peak first."""
    best: list[FrontierPoint] = []
    for p in sorted(points, key=lambda p: (p.peak, p.cost)):
        if not best or p.cost < best[-1].cost:
            best.append(p)
    return best


def frontier(
    spec: ModelSpec,
    wl: Workload,
    *,
    measured: str | Path | None = None,
    times: Times | None = None,
    offload: float | None = None,
    losses: Sequence[str] = (),
    host_budget: float | None = None,
) -> list[FrontierPoint]:
    """The Pareto frontier of predicted peak vs recompute cost, smallest peak first (arguments as ``plan``'s)."""
    wl.check(spec)
    return _frontier(spec, wl, measured, times, offload, losses, host_budget)[0]


Times = Mapping[str, float] | Callable[[Workload], Mapping[str, float]]
"""Predicted step seconds of every uniform policy, or a function giving them for a workload (a loss mode)."""


def _frontier(
    spec: ModelSpec,
    wl: Workload,
    measured: str | Path | None,
    times: Times | None,
    offload: float | None,
    losses: Sequence[str],
    host_budget: float | None = None,
) -> tuple[list[FrontierPoint], _Chain, list[FrontierPoint]]:
    """The frontier over every loss mode in ``losses`` (default: ``wl.loss``), the chain of ``wl``'s mode and
    that mode's own frontier."""
    modes = tuple(dict.fromkeys(losses or (wl.loss,)))
    require(
        measured is None or modes == (wl.loss,),
        "a measured bench file prices one loss mode: plan with its loss only",
        fields=("loss",),
    )

    def costs(w: Workload) -> tuple[dict[str, float], float]:
        step_times = times(w) if callable(times) else times
        require(
            step_times is None or callable(times) or w.loss == wl.loss,
            "predicted times of one loss mode cannot price another; pass a function of the workload",
        )
        return policy_costs(spec, w, measured, step_times)

    timed = measured is not None or times is not None
    base_costs, base = costs(wl)
    chains = {wl.loss: _chain(spec, wl, base_costs, base, timed, offload, host_budget)}
    by_mode: dict[str, list[FrontierPoint]] = {}
    for mode in modes:
        w = _with_loss(wl, mode)
        if mode not in chains:
            chains[mode] = _chain(spec, w, *costs(w), timed, offload, host_budget)
        extra = _loss_cost(spec, w, chains[mode]) - _loss_cost(spec, wl, chains[wl.loss])
        by_mode[mode] = _candidates(chains[mode], loss=mode, extra=extra, base=base)
    return _pareto([p for points in by_mode.values() for p in points]), chains[wl.loss], by_mode.get(wl.loss, [])


def _loss_cost(spec: ModelSpec, wl: Workload, chain: _Chain) -> float:
    """What a loss mode costs a step in the chain's unit: the step's own time when costs are seconds, else the
    FLOPs it replays (none: the chunked loss takes its gradients in the forward)."""
    if chain.timed:
        return chain.model_cost
    return recompute_flops(spec, wl, ("none",) * spec.n_layers)


def require_fits(
    spec: ModelSpec,
    wl: Workload,
    budget: float,
    *,
    offload: bool = False,
    losses: Sequence[str] = (),
    host_budget: float | None = None,
) -> None:
    """Check that some plan fits ``budget`` before anything is spent pricing plans (the peaks depend on no cost).

    Raises:
        ConfigError: nothing fits; the message gives the smallest achievable peak and what would fit.
    """
    smallest = frontier(spec, wl, offload=0.0 if offload else None, losses=losses, host_budget=host_budget)[0].peak
    if smallest > budget:
        raise ConfigError(_nothing_fits(spec, wl, budget, smallest), fields=ALTERNATIVE_FIELDS)


def _fitting(points: Sequence[FrontierPoint], budget: float) -> FrontierPoint | None:
    fits = [p for p in points if p.peak <= budget]
    return min(fits, key=lambda p: (p.cost, p.peak)) if fits else None


def _choose(points: Sequence[FrontierPoint], own: Sequence[FrontierPoint], budget: float) -> FrontierPoint | None:
    """The cheapest point that fits; at equal cost one of ``own``, the workload's loss mode (another loss mode
    changes the training loop: the chunked loss returns no logits)."""
    chosen, kept = _fitting(points, budget), _fitting(own, budget)
    return kept if kept is not None and chosen is not None and kept.cost <= chosen.cost else chosen


def best_uniform(
    spec: ModelSpec, wl: Workload, budget: float, *, names: Sequence[str] = ("block",)
) -> tuple[Policy, Estimate] | None:
    """The cheapest 'recompute every k-th layer' setting that fits, or None.

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


def plan(
    spec: ModelSpec,
    wl: Workload,
    budget: float,
    *,
    measured: str | Path | None = None,
    traced_peak: Callable[[Policy, Workload], float] | None = None,
    times: Times | None = None,
    time_device: str = "",
    offload: float | None = None,
    losses: Sequence[str] = (),
    host_budget: float | None = None,
) -> Plan:
    """The least-cost per-layer policy whose predicted peak is at most ``budget`` bytes.

    Args:
        measured: a ``recompute bench --json`` result of this model: plan on its measured step times.
        times: predicted step seconds of every uniform policy on ``time_device`` (``recompute.core.timing``):
            plan on predicted time. A function of the workload when ``losses`` has another mode than ``wl``'s.
        offload: the cost of offloading one layer in the unit of the costs (``offload_seconds``); None leaves
            offload out.
        host_budget: host-memory bytes per rank that offloaded layers may take (their saved tensors, pinned,
            all micro-batches in flight): a plan offloads no more layers than fit; None: unchecked.
        losses: the loss modes to choose from (``full``, ``chunked``); default ``wl.loss`` alone.
        traced_peak: the peak of a policy's real step at a workload (the plan's loss mode), e.g.
            ``recompute.trace``'s on fake tensors (the CLI's
            ``plan --trace``); while the chosen plan's is over the budget, re-plan against a budget lowered by
            the overshoot. The analytic peak is within 0.7 % of the trace
            (``recompute validate --peaks``) but may fall on either side; with ``traced`` the plan fits by
            the arbiter's count. Needs torch; one full-size trace takes seconds to a minute.

    Raises:
        ConfigError: nothing fits; the message gives the smallest achievable peak and what would fit.
    """
    wl.check(spec)
    points, chain, own = _frontier(spec, wl, measured, times, offload, losses, host_budget)
    chosen = _choose(points, own, budget)
    if chosen is None:
        raise ConfigError(_nothing_fits(spec, wl, budget, points[0].peak), fields=ALTERNATIVE_FIELDS)
    peak_of_trace = None
    if traced_peak is not None:
        chosen, peak_of_trace = _fit_traced(spec, wl, (points, own), chosen, budget, traced_peak)
    if chosen not in points:  # the workload's own loss, at the cost of a point of the other's
        points = sorted([*points, chosen], key=lambda p: (p.peak, p.cost))
    policy = _policy(spec, wl, chosen)
    uniform = {}
    for name in chain.names:
        cost = chain.stages * chain.n * chain.cost[name]
        peak = estimate(spec, wl, name).peak
        uniform[name] = FrontierPoint(
            peak=peak, cost=cost, overhead=cost / chain.model_cost, layers=(name,) * chain.n, loss=wl.loss
        )
    planned = _with_loss(wl, chosen.loss)
    return Plan(
        model=spec.name,
        workload=planned.to_dict(),
        budget=budget,
        policy=policy,
        estimate=estimate(spec, planned, policy),
        cost=chosen.cost,
        overhead=chosen.overhead,
        cost_kind="measured seconds"
        if measured
        else f"predicted seconds on {time_device or 'a device'}"
        if times is not None
        else "FLOPs",
        frontier=tuple(points),
        uniform=uniform,
        traced_peak=peak_of_trace,
        model_cost=chain.model_cost,
        tokens=wl.micro_batch * wl.seq_len,
    )


def _with_loss(wl: Workload, loss: str) -> Workload:
    return wl if loss == wl.loss else replace(wl, loss=loss, loss_chunk=wl.loss_chunk if loss == "chunked" else None)


def _policy(spec: ModelSpec, wl: Workload, point: FrontierPoint) -> Policy:
    """The whole model's policy for a frontier point of the first pipeline stage."""
    return Policy(layers=(point.layers * wl.pp)[: spec.n_layers], model=spec.name)


def _fit_traced(
    spec: ModelSpec,
    wl: Workload,
    fronts: tuple[Sequence[FrontierPoint], Sequence[FrontierPoint]],
    chosen: FrontierPoint,
    budget: float,
    traced_peak: Callable[[Policy, Workload], float],
) -> tuple[FrontierPoint, float]:
    """The cheapest frontier point whose traced peak fits ``budget``, and that peak.

    ``fronts``: every loss mode's frontier and the workload's own (``_choose``). Each round traces the
    candidate in its loss mode; an overshoot lowers the analytic target by that much (the analytic error is
    nearly the same for neighbouring plans), and the next candidate is traced in turn.
    """
    points, own = fronts
    target = budget
    for _ in range(len(points) + len(own)):
        peak = float(traced_peak(_policy(spec, wl, chosen), _with_loss(wl, chosen.loss)))
        if peak <= budget:
            return chosen, peak
        target -= max(peak - budget, 1.0)
        lower = _choose(points, own, target)
        if lower is None:
            break
        chosen = lower
    raise ConfigError(
        f"no plan's traced peak fits {gib(budget)} (the smallest predicted peak is "
        f"{gib(points[0].peak)}); raise the budget or see the fixes without trace",
        fields=("trace",),
    )


def _nothing_fits(spec: ModelSpec, wl: Workload, budget: float, smallest: float) -> str:
    fits = []
    for label, change in _alternatives(spec, wl):
        try:
            best = frontier(spec, change)[0].peak
        except ConfigError:
            continue
        if best <= budget:
            fits.append(f"{label} ({best / GiB:.1f} GiB)")
            break  # the first, least invasive change that fits
    fix = f"; would fit: {fits[0]}" if fits else "; use a smaller micro-batch or sequence, or more GPUs"
    return (
        f"no plan fits {budget / GiB:.1f} GiB: the smallest achievable peak of {spec.name} at "
        f"b={wl.micro_batch} s={wl.seq_len} is {smallest / GiB:.1f} GiB{fix}"
    )


ALTERNATIVE_FIELDS = ("attention", "micro_batch", "precision", "dp", "tp", "sp")
"""The workload fields ``_alternatives`` changes (the advice names them)."""


def _alternatives(spec: ModelSpec, wl: Workload) -> list[tuple[str, Workload]]:
    """Changes that lower the peak, one at a time and then cumulatively, least invasive first."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if wl.attention == "eager":
        steps.append(("attention flash", {"attention": "flash"}))
    if wl.micro_batch > 1:
        steps.append((f"micro_batch {wl.micro_batch // 2}", {"micro_batch": wl.micro_batch // 2}))
    if wl.precision != "distributed":
        steps.append(("precision distributed dp 8", {"precision": "distributed", "dp": max(wl.dp, 8)}))
    t = wl.tp * 2
    if spec.n_heads % t == 0 and spec.n_kv_heads % t == 0 and wl.seq_len % t == 0:
        steps.append((f"tp {t} sp", {"tp": t, "sp": True}))
    out = [(label, replace(wl, **change)) for label, change in steps]
    labels, merged = [], {}
    for label, change in steps:
        labels.append(label)
        merged.update(change)
        if len(labels) > 1:
            out.append((" ".join(labels), replace(wl, **merged)))
    return out

"""The one search: the least-cost assignment of options to a chain of layers whose peak fits a budget, and the
Pareto frontier of (peak, cost), over any ``CostTable`` (a preset's or a profiled model's). Torch-free, numpy.

A dynamic programme over the layers, bottom up. After layer i is chosen a partial plan is a state:

- X: bytes held by the layers up to i, but for the part of layer i's that depends on the next layer's option
  (``CostTable.links``), which the next step adds;
- R: layer i's backward phase, but for the part that depends on the next layer's option (once nothing does,
  it is settled into M);
- M: the highest phase settled so far; C: the cost so far; U: host bytes taken (offload).

Every phase still to come grows with X and the peak with M, so of two states that agree on everything the
future reads (the key: how layer i's link depends on the next option, what it adds to the next layer's
backward, R - X, and the host bytes when a host budget caps them) one that has no more X, no more C and no
more M than the other dominates it: the search keeps, per key, the Pareto set of (X, C, M). That is exact for
any table, with any number k of micro-batches in flight (every layer phase then also carries (k - 1) S, S
the stage's total, known at the end), for the cheapest plan under a budget and for the whole frontier.
tests/test_plan.py holds it to brute force over both kinds of table. A budget prunes the states that cannot
fit on the way.

``smallest_peak`` drops the costs and keeps the Pareto set of (X, M).

Note: [settled states] with one micro-batch in flight the peak is max(fixed, M at the end), so M below the fixed
phases is raised to them. And a state whose M no later phase can pass, whatever the layers above choose (the
most each can reach above X, ``_ceilings``, a max-DP from the top), has its peak decided: the cheapest way to
finish it (every layer above its cheapest option, ``_Tail``) is its only useful completion, so it leaves the DP
as a finished plan (``done``, a Pareto set of (peak, cost)). When the gradients the backward makes dominate (a
large model at a short sequence: the lowest layer's backward is the step's peak) nearly every state settles at
the first layers. The 48-layer Qwen3-30B-A3B profile at s = 4096 kept 1.2 million states over 8.2 million
candidates before (3.8 s of search, 7.9 s of `recompute plan`), 5 after, for the same frontier and plans (issue
39; ``python benchmarks/plan_speed.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from recompute.core.costs import Composed, CostTable

__all__ = ["Searched", "search", "smallest_peak"]


@dataclass(frozen=True)
class Searched:
    """What one search found: the cheapest assignment that fits (None: nothing does) and the frontier."""

    chosen: Composed | None
    frontier: tuple[Composed, ...]
    """Assignments that fit, none both larger and dearer than another, smallest peak first."""


def search(table: CostTable, budget: float = math.inf, *, host_budget: float | None = None) -> Searched:
    """The least-cost assignment of ``table`` whose peak is at most ``budget``, and the frontier of those that fit.

    The cost is the table's (seconds when priced in time, else FLOPs); of equal costs, the smaller peak. A
    ``host_budget`` caps the host bytes of the offloaded layers. With no ``budget`` the frontier is the whole
    Pareto set of (peak, cost) the search reaches.
    """
    import numpy as np

    states = _States(table, budget, host_budget, costs=True)
    if states.peak is None:
        return Searched(None, ())
    peak, cost = states.peak, states.cost
    order = np.lexsort((cost, peak))  # by peak, then cost
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(cost[order])[:-1]))
    front = tuple(table.compose(states.layers(int(i))) for i in order[cost[order] < best_before])
    cheapest = int(np.lexsort((peak, cost))[0])  # by cost, then peak
    return Searched(table.compose(states.layers(cheapest)), front)


def smallest_peak(table: CostTable, *, host_budget: float | None = None) -> float:
    """The smallest peak any assignment of ``table`` reaches (within ``host_budget``); exact."""
    states = _States(table, math.inf, host_budget, costs=False)
    return math.inf if states.peak is None else float(states.peak.min())


class _Kind:
    """A kind's options as arrays: the search's view of ``KindCosts``."""

    def __init__(self, table: CostTable, index: int, *, costs: bool) -> None:
        import numpy as np

        kind = table.kinds[index]
        self.names = list(kind.options)
        self.forward = np.array([kind.forward[o] for o in self.names], dtype=float)
        self.cost = np.array([kind.cost(o, table.timed) if costs else 0.0 for o in self.names], dtype=float)
        self.below = np.array([kind.below.get(o, 0.0) for o in self.names], dtype=float)
        self.host = np.array([kind.host.get(o, 0.0) for o in self.names], dtype=float)


class _Handover:
    """How one layer's options hand over to the next layer's (the top layer's: to the head).

    ``h0[p]``, ``b0[p]``: what option p holds and adds to its own backward when the next option is the first
    one; ``dh[p, q]``, ``db[p, q]``: the change for next option q; ``cls[p]``: options whose changes are the
    same share a class; ``settled[p]``: p's backward does not depend on the next option. For the top layer
    ``head_forward[p]``, ``head_backward[p]`` are the head's deltas.
    """

    def __init__(self, held: Any, back: Any, head_forward: Any = None, head_backward: Any = None) -> None:
        import numpy as np

        self.h0, self.b0 = held[:, 0].copy(), back[:, 0].copy()
        self.dh, self.db = held - self.h0[:, None], back - self.b0[:, None]
        self.settled = np.all(self.db == 0, axis=1)
        self.least = self.h0 + self.dh.min(axis=1)  # the least option p holds, whatever follows
        signatures: dict[Any, int] = {}
        self.cls = [
            signatures.setdefault((self.dh[p].tobytes(), self.db[p].tobytes()), len(signatures))
            for p in range(len(held))
        ]
        self.rep = {c: self.cls.index(c) for c in signatures.values()}
        self.head_forward, self.head_backward = head_forward, head_backward

    def rows(self, cls: int) -> tuple[Any, Any]:
        """The (dh, db) rows of a class."""
        p = self.rep[cls]
        return self.dh[p], self.db[p]


def _handovers(table: CostTable, kinds: list[_Kind]) -> list[_Handover]:
    import numpy as np

    out = []
    for i in range(table.n):
        a = kinds[table.layer_kind[i]]
        if i < table.n - 1:
            b = kinds[table.layer_kind[i + 1]]
            link = table.link(i)
            held = np.array([[link[p][q].held for q in b.names] for p in a.names], dtype=float)
            back = np.array([[link[p][q].backward for q in b.names] for p in a.names], dtype=float)
            out.append(_Handover(held, back))
        else:
            last = np.array([table.last[p] for p in a.names], dtype=float)  # (held, back, head f, head b)
            out.append(_Handover(last[:, :1], last[:, 1:2], last[:, 2], last[:, 3]))
    return out


class _States:
    """The DP of the module docstring, run to the end: the final states' peaks and costs, and the way back."""

    def __init__(self, table: CostTable, budget: float, host_budget: float | None, *, costs: bool) -> None:
        self.table = table
        self.kinds = [_Kind(table, k, costs=costs) for k in range(len(table.kinds))]
        self.handovers = _handovers(table, self.kinds)
        self.budget = budget * (1 + 1e-12)  # the search adds up in another order than compose: rounding slack
        self.costs = costs
        self.cap = math.inf if host_budget is None else host_budget
        self.capped = host_budget is not None
        self.extra = table.in_flight - 1  # (k - 1): every layer phase also carries (k - 1) S
        self.fixed = max(table.fixed.values(), default=-math.inf)
        # Held bytes that never shrink from layer to layer bound (k - 1) S from below by (k - 1) X on the way.
        self.held_grows = self.extra > 0 and all(
            cost.held >= 0 for link in table.links.values() for row in link.values() for cost in row.values()
        )
        self.settles = self.extra == 0 and table.n > 1  # Note: [settled states]
        if self.settles:
            self.ceilings = _ceilings(table, self.kinds, self.handovers)
            self.tail = _Tail(table, self.kinds)
        self.done: list[tuple[Any, ...]] = []
        """Settled states: (peak, cost, parent, option, layer) arrays, a Pareto set of (peak, cost)."""
        self.steps: list[dict[str, Any]] = []
        self.peak: Any = None
        self.cost: Any = None
        self._run()

    def _run(self) -> None:
        import numpy as np

        start: dict[str, Any] = {"X": np.zeros(1), "R": np.full(1, -np.inf), "M": np.full(1, -np.inf)}
        start |= {"C": np.zeros(1), "U": np.zeros(1), "keys": [(None, np.zeros(1, dtype=int))]}
        previous: dict[str, Any] | None = start
        for i in range(self.table.n):
            assert previous is not None
            step = self._step(i, previous)
            self.steps.append(step or {})
            if step is None:
                break
            previous = step
        peaks, costs = [], []
        if previous is not None and len(self.steps) == self.table.n and self.steps[-1]:
            S = previous["X"]
            peaks.append(np.maximum(self.fixed, previous["M"] + self.extra * S))
            costs.append(previous["C"])
        self.finals = int(sum(a.size for a in peaks))
        if self.done:
            peaks.append(self.done[0])
            costs.append(self.done[1])
        if peaks:
            self.peak, self.cost = np.concatenate(peaks), np.concatenate(costs)

    def _step(self, i: int, prev: dict[str, Any]) -> dict[str, Any] | None:
        """The states after layer i from those after layer i - 1, pruned to their Pareto sets per key."""
        import numpy as np

        table, kind, after = self.table, self.kinds[self.table.layer_kind[i]], self.handovers[i]
        top = i == table.n - 1
        chunks: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
        for key, idx in prev["keys"]:
            X, R, M, C, U = (prev[name][idx] for name in "XRMCU")
            if key is None:  # below the first layer
                dh = db = np.zeros(len(kind.names))
                pend = 0.0
            else:
                dh, db = self.handovers[i - 1].rows(key[0])
                pend = key[1]
            for q in range(len(kind.names)):
                P = X + dh[q]  # held by the layers below i
                m = np.maximum(np.maximum(M, R + db[q]), table.base_forward[i] + P + kind.forward[q])
                x = P + after.h0[q]
                r = table.base_backward[i] + P + after.b0[q] + pend
                if after.settled[q]:
                    m, r = np.maximum(m, r), np.full_like(r, -np.inf)
                if self.extra == 0:  # the fixed phases are the least peak: below them, M makes no difference
                    m = np.maximum(m, self.fixed)
                if top:
                    head = np.maximum(
                        table.head_forward + after.head_forward[q], table.head_backward + after.head_backward[q]
                    )
                    m = np.maximum(m, head + x)
                u = U + kind.host[q]
                if top:
                    low = np.maximum(m + self.extra * x, self.fixed)
                else:
                    low = m + self.extra * (P + after.least[q]) if self.held_grows else m
                ok = np.flatnonzero((low <= self.budget) & (u <= self.cap))
                if self.settles and not top and ok.size:
                    ok = self._settle(i, q, ok, (x, r, m, C + kind.cost[q], u, idx))
                if ok.size == 0:
                    continue
                offset = None if after.settled[q] else float(after.b0[q] - after.h0[q] + pend)
                base_key = (after.cls[q], float(kind.below[q]), offset)
                arrays = (x[ok], r[ok], m[ok], (C + kind.cost[q])[ok], u[ok], idx[ok], np.full(ok.size, q))
                if not self.capped:
                    chunks[base_key].append(arrays)
                    continue
                for used in np.unique(np.round(arrays[4])):
                    part = np.flatnonzero(np.round(arrays[4]) == used)
                    capped_key = (*base_key, float(used))
                    chunks[capped_key].append(tuple(a[part] for a in arrays))
        if not chunks:
            return None
        return self._pareto(chunks)

    def _pareto(self, chunks: dict[Any, list[tuple[Any, ...]]]) -> dict[str, Any]:
        """Per key, the states no other is below in X, C and M at once (X and M without costs)."""
        import numpy as np

        kept: list[tuple[Any, ...]] = []
        keys = []
        start = 0
        for key, parts in chunks.items():
            x, r, m, c, u, parent, option = (np.concatenate(col) for col in zip(*parts))
            keep = _pareto3(x, c, m) if self.costs else _pareto2(x, m)
            kept.append((x[keep], r[keep], m[keep], c[keep], u[keep], parent[keep], option[keep]))
            keys.append((key, np.arange(start, start + keep.size)))
            start += keep.size
        X, R, M, C, U, parent, option = (np.concatenate(col) for col in zip(*kept))
        return {"X": X, "R": R, "M": M, "C": C, "U": U, "parent": parent, "option": option, "keys": keys}

    def _settle(self, i: int, q: int, ok: Any, state: tuple[Any, ...]) -> Any:
        """Move the states (of ``ok``) whose peak no phase after layer i can raise to ``done``, finished the
        cheapest way; the indices of the others. Note: [settled states]"""
        import numpy as np

        x, r, m, c, u, idx = (a[ok] for a in state)
        cls = self.handovers[i].cls[q]
        ceiling = np.maximum(r + self.handovers[i].rows(cls)[1].max(), x + self.ceilings[i][cls])
        peak = np.maximum(m, self.fixed)
        settled = (ceiling <= peak) & (u + self.tail.host[i + 1] <= self.cap)
        if not settled.any():
            return ok
        count = int(settled.sum())
        done: list[Any] = [peak[settled], c[settled] + self.tail.cost[i + 1], idx[settled]]
        done += [np.full(count, q), np.full(count, i)]
        if self.done:
            done = [np.concatenate(pair) for pair in zip(self.done, done)]
        keep = _pareto2(done[0], done[1])
        self.done = [a[keep] for a in done]
        return ok[~settled]

    def layers(self, index: int) -> tuple[str, ...]:
        """The options of final state ``index``, by its back-pointers (a settled one finished the cheapest way)."""
        if index < self.finals:
            return self._path(self.table.n - 1, index)
        _, _, parent, option, layer = (int(a[index - self.finals]) for a in self.done)
        own = self.kinds[self.table.layer_kind[layer]].names[option]
        return (*self._path(layer - 1, parent), own, *self.tail.names[layer + 1 :])

    def _path(self, last: int, index: int) -> tuple[str, ...]:
        """The options of layers 0..``last`` of state ``index`` after layer ``last``, by its back-pointers."""
        out = []
        for i in range(last, -1, -1):
            step = self.steps[i]
            out.append(self.kinds[self.table.layer_kind[i]].names[int(step["option"][index])])
            index = int(step["parent"][index])
        return tuple(reversed(out))


class _Tail:
    """The cheapest way to finish the chain from each layer: every layer's first option of least cost.

    ``names[j]``: layer j's; ``cost[j]``, ``host[j]``: the cost and host bytes of layers j and above (0 at n)."""

    def __init__(self, table: CostTable, kinds: list[_Kind]) -> None:
        import numpy as np

        own = [kinds[k] for k in table.layer_kind]
        picks = [int(np.argmin(kind.cost)) for kind in own]
        self.names = [kind.names[p] for kind, p in zip(own, picks)]
        self.cost = np.concatenate((np.cumsum([k.cost[p] for k, p in zip(own, picks)][::-1])[::-1], [0.0]))
        self.host = np.concatenate((np.cumsum([k.host[p] for k, p in zip(own, picks)][::-1])[::-1], [0.0]))


def _ceilings(table: CostTable, kinds: list[_Kind], handovers: list[_Handover]) -> list[dict[int, float]]:
    """Per layer i < n - 1 and handover class of its option: the most any phase after layer i's own can reach
    above X, the bytes held after layer i, whatever the layers above choose (Note: [settled states]).

    Backward from the top: U_j(q), the most a phase of layer j (option q) or above reaches above the bytes the
    layers below j hold, is the largest of its forward, its backward (with the most the next option and the
    layer below can add) and, over the next option, what it holds plus U_{j+1}; the top layer's later phases
    are the head's."""
    import numpy as np

    n = table.n
    below = [max(0.0, float(kinds[k].below.max(initial=0.0))) for k in table.layer_kind]
    ceiling: list[Any] = [None] * n
    for j in range(n - 1, 0, -1):
        kind, after = kinds[table.layer_kind[j]], handovers[j]
        own = np.maximum(
            table.base_forward[j] + kind.forward,
            table.base_backward[j] + after.b0 + after.db.max(axis=1) + below[j - 1],
        )
        if j == n - 1:
            head = np.maximum(table.head_forward + after.head_forward, table.head_backward + after.head_backward)
            later = head + after.h0
        else:
            later = (after.h0[:, None] + after.dh + ceiling[j + 1][None, :]).max(axis=1)
        ceiling[j] = np.maximum(own, later)
    return [
        {cls: float(np.max(handovers[i].rows(cls)[0] + ceiling[i + 1])) for cls in set(handovers[i].cls)}
        for i in range(n - 1)
    ]


def _pareto2(x: Any, y: Any) -> Any:
    """Indices of the points no other is below in both x and y (of equal points, the first)."""
    import numpy as np

    order = np.lexsort((y, x))
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(y[order])[:-1]))
    return order[y[order] < best_before]


def _pareto3(x: Any, c: Any, m: Any) -> Any:
    """Indices of the points no other is below in x, c and m at once.

    The (x, c) front (of equal points, the least m) is kept; another point survives only if no front point in
    its (x, c) quadrant has an m as small (a range minimum over the front, which is sorted by x up and c down);
    the few that survive are filtered among themselves, exactly, one by one.
    """
    import numpy as np

    order = np.lexsort((m, c, x))
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(c[order])[:-1]))
    front = order[c[order] < best_before]
    if front.size == x.size:
        return front
    rest = np.setdiff1d(np.arange(x.size), front, assume_unique=True)
    fx, fc, fm = x[front], c[front], m[front]
    hi = np.searchsorted(fx, x[rest], side="right") - 1  # the last front point with x <= the point's
    lo = np.searchsorted(-fc, -c[rest], side="left")  # the first with c <= the point's
    low_m = _range_min(fm, lo, hi)
    alive = rest[~((lo <= hi) & (low_m <= m[rest]))]
    if alive.size == 0:
        return front
    # No point dominates a front point, and a point dominated by one the front dominates is dominated by the front:
    # only the survivors need filtering among themselves (the front was most of the staircase's work, issue 39).
    both = np.concatenate((front, alive[_staircase(x[alive], c[alive], m[alive])]))
    return both[np.lexsort((m[both], c[both], x[both]))]


def _range_min(values: Any, lo: Any, hi: Any) -> Any:
    """min(values[lo[j] : hi[j] + 1]) for each j (inf where lo > hi): a sparse table of powers of two."""
    import numpy as np

    levels = [values]
    while (1 << len(levels)) <= values.size:
        half = 1 << (len(levels) - 1)
        prev = levels[-1]
        levels.append(np.minimum(prev[:-half], prev[half:]))
    length = np.maximum(hi - lo + 1, 1)
    k = np.floor(np.log2(length)).astype(int)
    out = np.full(lo.size, np.inf)
    ok = lo <= hi
    for level in np.unique(k[ok]):
        sel = np.flatnonzero(ok & (k == level))
        table = levels[level]
        out[sel] = np.minimum(table[lo[sel]], table[hi[sel] - (1 << level) + 1])
    return out


def _staircase(x: Any, c: Any, m: Any) -> list[int]:
    """The exact 3-D filter, point by point in order of x: a point is dominated when an earlier one has no
    more c and no more m (the earlier points' (c, m) front, a staircase, answers by bisection)."""
    import bisect

    import numpy as np

    keep: list[int] = []
    stair_c: list[float] = []
    stair_m: list[float] = []
    for i in np.lexsort((m, c, x)).tolist():
        ci, mi = float(c[i]), float(m[i])
        j = bisect.bisect_right(stair_c, ci) - 1
        if j >= 0 and stair_m[j] <= mi:
            continue
        keep.append(i)
        k = j + 1
        while k < len(stair_c) and stair_m[k] >= mi:
            k += 1
        stair_c[j + 1 : k] = [ci]
        stair_m[j + 1 : k] = [mi]
    return keep

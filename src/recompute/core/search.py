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
        self.steps: list[dict[str, Any]] = []
        self.peak: Any = None
        self.cost: Any = None
        self._run()

    def _run(self) -> None:
        import numpy as np

        start: dict[str, Any] = {"X": np.zeros(1), "R": np.full(1, -np.inf), "M": np.full(1, -np.inf)}
        start |= {"C": np.zeros(1), "U": np.zeros(1), "keys": [(None, np.zeros(1, dtype=int))]}
        previous = start
        for i in range(self.table.n):
            step = self._step(i, previous)
            if step is None:
                return
            self.steps.append(step)
            previous = step
        S = previous["X"]
        self.peak = np.maximum(self.fixed, previous["M"] + self.extra * S)
        self.cost = previous["C"]

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

    def layers(self, index: int) -> tuple[str, ...]:
        """The options of final state ``index``, by its back-pointers."""
        out = []
        for i in range(len(self.steps) - 1, -1, -1):
            step = self.steps[i]
            out.append(self.kinds[self.table.layer_kind[i]].names[int(step["option"][index])])
            index = int(step["parent"][index])
        return tuple(reversed(out))


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
    the few that survive are filtered among themselves and the front, exactly, one by one.
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
    both = np.concatenate((front, alive))
    return both[_staircase(x[both], c[both], m[both])]


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

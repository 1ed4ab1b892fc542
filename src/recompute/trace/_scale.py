"""Scale traces of a few layers up to the whole model: every run of alike layers longer than K + 1 is traced at K
and at K + 1 layers, and every figure follows exactly.

Note: [why two traces are exact] With alike layers, every byte count of a phase is affine in the layer count L:
the parameters, gradients and optimizer state grow by one layer's worth per layer, and so does the activation
memory held while the step passes a given layer. Within the forward or the backward, the memory seen at layer j
is affine in j as well (layers below hold their activations, layers above their gradients), so the largest value
over the layers is at the first or the last layer. Tracing K and K + 1 layers therefore gives, for the first
layer, the last layer and every phase outside the layers, f(L) = f(K) + (L - K) * (f(K + 1) - f(K)). Under
``offload`` a layer's backward also holds the layer below's prefetched copies, which layer 0 has none of: the
largest layer phase can be layer 1's, so with K >= 2 layer 1 is a third category (``trace`` asks for K >= 2
under offload). Per-layer saved tensors are copied from the last traced layer (layer 0 can differ: it is the
first to save tensors the layers share, such as rotary tables). tests/test_trace_scale.py (and test_offload.py,
for offload) check the result equals a full trace byte for byte.

Note: [runs of alike layers] Where the layers differ (DeepSeek-V3: three dense layers, then MoE layers), the model
is a sequence of runs of alike layers (``_kinds.runs_of``). Every figure is a sum over the layers, so it is
affine in each run's length with the others fixed, and jointly so (no layer's bytes depend on another run's
length): one trace with every long run cut to K layers and, per long run, one with that run at K + 1 give
f = f(base) + sum over long runs of (length - K) * (f(run at K + 1) - f(base)). The categories above are taken
per run (its first, second and last layer); a run of at most K + 1 layers is traced whole, layer by layer.
tests/test_trace_scale.py holds a dense-first MoE model's scaled trace to its full trace.

Note: [FSDP2's last two layers] under FSDP2 (``fsdp=True``) a layer's backward also holds the next layer's
reduce-scatter input (until its own), which the last layer has none of, and the previous layer's prefetched
all-gather, which layer 0 has none of; the forward of layer 0 still holds the root's all-gather. The layers
between are affine in j, so the largest is at layer 1 or at the next to last: both are categories of their own
(``second``, ``penult``), which needs K >= 3 (``trace`` asks for it under fsdp). tests/test_fsdp.py holds scaled
traces to full ones.

Note: [every layer's phase] A trace needs only the phases that can hold the peak (each run's first, second and last
layer); a profile's whole step (``recompute.trace._profile``) needs every layer's, its base for any plan. A middle
layer's figure is affine in its place j and in the run's length L together (the layers below hold their
activations, those above their gradients, and every layer its states): f(j, L) = f(1, L) + (j - 1) * s, with f(1, L)
scaled as the second layer is and the slope s read from the trace of K + 1 layers, whose layers 1 and 2 are both
middle ones for K >= 3 (``scale_whole``). Its FLOPs and kernels follow as ``recompute.core.timing.scale_work``'s:
every layer's copied from the trace of K + 1 layers, those outside the layers affine in L.
tests/test_profile.py holds the scaled record to the full step's in every field a profile reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from recompute.core.timing import affine_ops, work_list
from recompute.trace._kinds import Run
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase, SavedRecord

__all__ = ["cut_counts", "grown", "scale_runs", "scale_whole", "scaled_runs"]

_Key = tuple[str, str, int, str, int]
"""(stage, part, run, category, offset): a phase of the step, its layer's run and place in that run."""


def scaled_runs(runs: Sequence[Run], k: int) -> tuple[int, ...]:
    """The runs (indices) longer than ``k + 1`` layers: those traced at ``k`` and ``k + 1`` layers."""
    return tuple(i for i, run in enumerate(runs) if run.length > k + 1)


def cut_counts(runs: Sequence[Run], k: int, grown: int | None = None) -> tuple[int, ...]:
    """Layers traced of each run: ``k`` of a long run (``k + 1`` of run ``grown``), every layer of a short one."""
    return tuple(run.length if run.length <= k + 1 else k + (1 if i == grown else 0) for i, run in enumerate(runs))


def _keys(phase: Phase, runs: Sequence[Run], counts: Sequence[int], k: int, fsdp: bool = False) -> list[_Key]:
    """Categories of a phase of a trace with ``counts`` layers per run (see the module notes; ``fsdp``: Note:
    [FSDP2's last two layers])."""
    if phase.part != "layer":
        return [(phase.stage, phase.part, -1, "", 0)]
    i, start = 0, 0
    while phase.layer >= start + counts[i]:
        start += counts[i]
        i += 1
    c, offset = counts[i], phase.layer - start
    if runs[i].length <= k + 1:
        return [(phase.stage, "layer", i, "at", offset)]
    keys = []
    if offset == 0:
        keys.append((phase.stage, "layer", i, "first", 0))
    if offset == 1 and k >= 2:  # layer 1 of the run is in both traces
        keys.append((phase.stage, "layer", i, "second", 0))
    if fsdp and offset == c - 2 and k >= 3:
        keys.append((phase.stage, "layer", i, "penult", 0))
    if offset == c - 1:
        keys.append((phase.stage, "layer", i, "last", 0))
    return keys


def _by_category(
    record: StepRecord, runs: Sequence[Run], counts: Sequence[int], k: int, fsdp: bool = False
) -> dict[_Key, tuple[int, dict[str, int]]]:
    out: dict[_Key, tuple[int, dict[str, int]]] = {}
    for phase, value in record.phase_peaks.items():
        for key in _keys(phase, runs, counts, k, fsdp):
            out[key] = value
    return out


def _phase(key: _Key, runs: Sequence[Run]) -> Phase:
    stage, part, i, which, offset = key
    if part != "layer":
        return Phase(stage, part)
    run = runs[i]
    index = {"at": offset, "first": 0, "second": 1, "penult": run.length - 2, "last": run.length - 1}[which]
    return Phase(stage, "layer", run.start + index)


def grown(base: int, bigs: Mapping[int, int], runs: Sequence[Run], k: int) -> int:
    """f(base) + sum over the long runs of (length - k) * (f(run at k + 1) - f(base))."""
    return base + sum((runs[i].length - k) * (big - base) for i, big in bigs.items())


def grown_dict(base: dict[str, int], bigs: Mapping[int, dict[str, int]], runs: Sequence[Run], k: int) -> dict[str, int]:
    keys = list(dict.fromkeys([*base, *(key for big in bigs.values() for key in big)]))
    return {key: grown(base.get(key, 0), {i: big.get(key, 0) for i, big in bigs.items()}, runs, k) for key in keys}


def scale_runs(
    base: StepRecord, bigs: Mapping[int, StepRecord], runs: Sequence[Run], k: int, *, fsdp: bool = False
) -> StepRecord:
    """The record of the whole model from ``base`` (every run cut as ``cut_counts(runs, k)``) and, for each long
    run ``i``, ``bigs[i]`` (the same with run ``i`` at ``k + 1`` layers); ``fsdp``: a rank of FSDP2 (Note:
    [FSDP2's last two layers]; ``k`` >= 3)."""
    if sorted(bigs) != list(scaled_runs(runs, k)):
        raise ValueError(f"need one trace per run longer than {k + 1} layers, got {sorted(bigs)}")
    if fsdp and k < 3:
        raise ValueError(f"a rank of FSDP2 scales from traces of 3 or more layers, got {k}")
    counts = cut_counts(runs, k)
    cat_base = _by_category(base, runs, counts, k, fsdp)
    cat_bigs = {i: _by_category(big, runs, cut_counts(runs, k, i), k, fsdp) for i, big in bigs.items()}
    phase_peaks = {}
    for key, (value, snap) in cat_base.items():
        values = {i: cat[key][0] for i, cat in cat_bigs.items()}
        snaps = {i: cat[key][1] for i, cat in cat_bigs.items()}
        phase_peaks[_phase(key, runs)] = (grown(value, values, runs, k), grown_dict(snap, snaps, runs, k))
    return StepRecord(
        n_layers=sum(run.length for run in runs),
        phase_peaks=phase_peaks,
        saved=_scaled_saved(base, bigs, runs, k),
        states=grown_dict(base.states, {i: big.states for i, big in bigs.items()}, runs, k),
        layer_deltas=_scaled_deltas(base, bigs, runs, k),
        host_peak=grown(base.host_peak, {i: big.host_peak for i, big in bigs.items()}, runs, k),
    )


def _run_layers(counts: Sequence[int], i: int) -> tuple[int, int]:
    """(first index, count) of run ``i``'s layers in a trace with ``counts`` layers per run."""
    return sum(counts[:i]), counts[i]


def _scaled_saved(
    base: StepRecord, bigs: Mapping[int, StepRecord], runs: Sequence[Run], k: int
) -> tuple[SavedRecord, ...]:
    """Saved records of every layer: a short run's from ``base``; a long run's first ``k + 1`` from its trace at
    ``k + 1`` layers, then copies of its last traced layer's. The records outside the layers from ``base``."""
    out: list[SavedRecord] = []
    for i, run in enumerate(runs):
        record, counts = (bigs[i], cut_counts(runs, k, i)) if i in bigs else (base, cut_counts(runs, k))
        first, count = _run_layers(counts, i)
        by_offset: list[list[SavedRecord]] = [[] for _ in range(count)]
        for r in record.saved:
            if first <= r.layer < first + count:
                by_offset[r.layer - first].append(r)
        for offset in range(run.length):
            template = by_offset[min(offset, count - 1)]
            out += [dataclasses.replace(r, layer=run.start + offset) for r in template]
    return tuple(out + [r for r in base.saved if r.layer < 0])


def _scaled_deltas(base: StepRecord, bigs: Mapping[int, StepRecord], runs: Sequence[Run], k: int) -> tuple[int, ...]:
    out: list[int] = []
    for i, run in enumerate(runs):
        record, counts = (bigs[i], cut_counts(runs, k, i)) if i in bigs else (base, cut_counts(runs, k))
        first, count = _run_layers(counts, i)
        deltas = record.layer_deltas[first : first + count]
        out += [deltas[min(offset, count - 1)] for offset in range(run.length)]
    return tuple(out)


def scale_whole(small: StepRecord, big: StepRecord, n: int, k: int) -> StepRecord:
    """The record of a step of ``n`` alike layers from steps of ``k`` (``small``) and ``k + 1`` (``big``) of
    them, with every layer's phase, FLOPs and kernels (Note: [every layer's phase]; ``k`` >= 3, not FSDP2): its
    ``phase_peaks``, ``saved``, ``states``, ``layer_deltas``, ``host_peak``, ``flops`` and ``work``, what a
    profile reads; the other fields (``layer_starts``, ``layer_grads``, ...) are left empty."""
    if k < 3 or n <= k + 1:
        raise ValueError(f"every layer's phase scales from traces of 3 or more layers to more, got {k} -> {n}")
    record = scale_runs(small, {0: big}, (Run(0, 0, n),), k)
    peaks = dict(record.phase_peaks)
    for stage in ("forward", "backward"):
        (one, at_one), (two, at_two) = (big.phase_peaks[Phase(stage, "layer", j)] for j in (1, 2))
        value, snap = peaks[Phase(stage, "layer", 1)]
        keys = dict.fromkeys([*snap, *at_one, *at_two])
        for j in range(2, n - 1):
            peaks[Phase(stage, "layer", j)] = (
                value + (j - 1) * (two - one),
                {key: snap.get(key, 0) + (j - 1) * (at_two.get(key, 0) - at_one.get(key, 0)) for key in keys},
            )
    flops: dict[Phase, dict[str, int]] = {}
    work: dict[Phase, dict[tuple[str, str, int, int], int]] = {}
    for phase in sorted({*big.flops, *big.work}, key=Phase.order):
        if phase.part == "layer":
            continue
        if phase in big.flops:
            flops[phase] = grown_dict(small.flops.get(phase, {}), {0: big.flops[phase]}, (Run(0, 0, n),), k)
        if phase in big.work:
            ops = affine_ops(work_list(small.work.get(phase, {})), work_list(big.work[phase]), k, n)
            work[phase] = {}
            for op in ops:
                work[phase][op[:4]] = work[phase].get(op[:4], 0) + op[4]
    for stage in ("forward", "backward"):  # layers 0 to k - 1 as traced, the middle ones as k - 1, the last as k
        for j in range(n):
            source = Phase(stage, "layer", j if j < k else k - 1 if j < n - 1 else k)
            at = Phase(stage, "layer", j)
            if source in big.flops:
                flops[at] = dict(big.flops[source])
            if source in big.work:
                work[at] = dict(big.work[source])
    return dataclasses.replace(
        record,
        phase_peaks=dict(sorted(peaks.items(), key=lambda kv: kv[0].order())),
        flops=dict(sorted(flops.items(), key=lambda kv: kv[0].order())),
        work=dict(sorted(work.items(), key=lambda kv: kv[0].order())),
    )

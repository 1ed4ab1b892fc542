"""Scale a trace of K identical layers up to L: two traces (K and K + 1 layers) give every figure exactly.

Note: [why two traces are exact] With identical layers, every byte count of a phase is affine in the layer
count L: the parameters, gradients and optimizer state grow by one layer's worth per layer, and so does the
activation memory held while the step passes a given layer. Within the forward or the backward, the memory
seen at layer j is affine in j as well (layers below hold their activations, layers above their gradients),
so the largest value over the layers is at the first or the last layer. Tracing K and K + 1 layers therefore
gives, for the first layer, the last layer and every phase outside the layers, f(L) = f(K) + (L - K) * (f(K + 1)
- f(K)). Under ``offload`` a layer's backward also holds the layer below's prefetched copies, which layer 0
has none of: the largest layer phase can be layer 1's, so with K >= 2 layer 1 is a third category (``trace``
asks for K >= 2 under offload). Per-layer saved tensors are copied from the last traced layer (layer 0 can
differ: it is the first to save tensors the layers share, such as rotary tables). tests/test_trace_scale.py
(and test_offload.py, for offload) check the result equals a full trace byte for byte.
"""

from __future__ import annotations

import dataclasses

from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase, SavedRecord

__all__ = ["scale_record"]


def _key(phase: Phase, n: int, second: bool) -> list[tuple[str, str, str]]:
    """Categories of a phase: a layer phase is ``first``, ``second`` (with ``second``) and/or ``last`` (a middle
    layer has none)."""
    if phase.part != "layer":
        return [(phase.stage, phase.part, "")]
    keys = []
    if phase.layer == 0:
        keys.append((phase.stage, "layer", "first"))
    if phase.layer == 1 and second:
        keys.append((phase.stage, "layer", "second"))
    if phase.layer == n - 1:
        keys.append((phase.stage, "layer", "last"))
    return keys


def _by_category(record: StepRecord, second: bool) -> dict[tuple[str, str, str], tuple[int, dict[str, int]]]:
    out: dict[tuple[str, str, str], tuple[int, dict[str, int]]] = {}
    for phase, value in record.phase_peaks.items():
        for key in _key(phase, record.n_layers, second):
            out[key] = value
    return out


def _affine(a: int, b: int, k: int, n: int) -> int:
    """f(n) from f(k) = a and f(k + 1) = b."""
    return a + (n - k) * (b - a)


def _affine_dict(a: dict[str, int], b: dict[str, int], k: int, n: int) -> dict[str, int]:
    keys = list(b) + [key for key in a if key not in b]
    return {key: _affine(a.get(key, 0), b.get(key, 0), k, n) for key in keys}


def _phase(key: tuple[str, str, str], n: int) -> Phase:
    stage, part, which = key
    if part != "layer":
        return Phase(stage, part)
    return Phase(stage, "layer", {"first": 0, "second": 1}.get(which, n - 1))


def scale_record(small: StepRecord, big: StepRecord, n_layers: int) -> StepRecord:
    """The record of an ``n_layers`` model from traces of K (``small``) and K + 1 (``big``) identical layers."""
    k = small.n_layers
    if big.n_layers != k + 1 or n_layers < big.n_layers:
        raise ValueError(f"need traces of K and K + 1 <= {n_layers} layers, got {k} and {big.n_layers}")
    second = k >= 2  # layer 1 is in both traces
    cat_small, cat_big = _by_category(small, second), _by_category(big, second)
    phase_peaks = {}
    for key, (value_big, snap_big) in cat_big.items():
        value_small, snap_small = cat_small[key]
        value = _affine(value_small, value_big, k, n_layers)
        phase_peaks[_phase(key, n_layers)] = (value, _affine_dict(snap_small, snap_big, k, n_layers))
    return StepRecord(
        n_layers=n_layers,
        phase_peaks=phase_peaks,
        saved=_scaled_saved(big.saved, k, n_layers),
        states=_affine_dict(small.states, big.states, k, n_layers),
        layer_deltas=big.layer_deltas + (big.layer_deltas[-1],) * (n_layers - k - 1),
        host_peak=_affine(small.host_peak, big.host_peak, k, n_layers),
    )


def _scaled_saved(saved: tuple[SavedRecord, ...], last: int, n_layers: int) -> tuple[SavedRecord, ...]:
    """Saved records of layers 0..last, then copies of layer ``last``'s for the layers up to ``n_layers``."""
    template = [r for r in saved if r.layer == last]
    layers = [r for r in saved if r.layer >= 0]
    copies = [dataclasses.replace(r, layer=j) for j in range(last + 1, n_layers) for r in template]
    outer = [r for r in saved if r.layer < 0]
    return tuple(layers + copies + outer)

"""``render_trace``: a ``TraceResult`` as plain text tables."""

from __future__ import annotations

from recompute.core.table import render_table, size
from recompute.trace._result import COMPONENTS, PartTrace, TraceResult

__all__ = ["render_trace"]


def _groups(r: TraceResult) -> list[tuple[str, str, PartTrace]]:
    """Runs of consecutive layers with the same policy and bytes: (``layers 1-11``, policy, first of them)."""
    runs: list[list[int]] = []
    for j, part in enumerate(r.layers):
        prev = runs[-1][-1] if runs else None
        same = prev is not None and r.per_layer[prev] == r.per_layer[j] and _bytes(r.layers[prev]) == _bytes(part)
        if same:
            runs[-1].append(j)
        else:
            runs.append([j])
    out = []
    for run in runs:
        label = f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}"
        out.append((label, r.per_layer[run[0]], r.layers[run[0]]))
    return out


def _bytes(p: PartTrace) -> tuple[dict[str, int], int]:
    return p.components, p.host


def _layer_table(r: TraceResult) -> str:
    parts = (*r.layers, r.embedding, r.head)
    used = [c for c in COMPONENTS if any(p.components.get(c) for p in parts)]
    host = ["in host memory"] if any(p.host for p in parts) else []

    def cells(p: PartTrace) -> list[str]:
        return [*(size(p.components.get(c, 0)) for c in used), size(p.total), *([size(p.host)] if host else [])]

    rows = [[label, pol, *cells(p)] for label, pol, p in _groups(r)]
    rows += [[p.name, "-", *cells(p)] for p in (r.embedding, r.head)]
    return render_table(["saved by", "policy", *used, "total", *host], rows)


def _ops_table(parts: list[PartTrace]) -> str:
    ops = sorted({op for p in parts for op in p.ops}, key=lambda op: -max(p.ops.get(op, 0) for p in parts))
    rows = [[op, *(size(p.ops.get(op, 0)) for p in parts)] for op in ops]
    return render_table(["read back by", *(p.name for p in parts)], rows)


def _title(r: TraceResult) -> str:
    w = r.workload
    how = f"traced {r.traced[0]} and {r.traced[1]} layers, scaled to {r.n_layers}" if r.scaled else "traced"
    return (
        f"{r.model}: b={w['micro_batch']} s={w['seq_len']} {w.get('dtype', '')} on {w['device']}, "
        f"{w.get('attention', '')} attention, policy {r.policy} ({how} in {r.seconds:.1f} s)"
    )


def render_trace(r: TraceResult) -> str:
    """The step's states, activations by layer and component, the ops that keep them, and the peak."""
    last = r.layers[-1]
    peak_parts = ", ".join(f"{k} {size(v)}" for k, v in r.peak_breakdown.items() if v and k != "Total")
    lines = [
        _title(r),
        f"model states: parameters {size(r.parameters)}, gradients {size(r.gradients)}, "
        f"optimizer {size(r.optimizer)}; buffers and batch {size(r.other)}",
        f"saved for the backward: {size(r.activations)} (layers {size(r.layer_activations)}, "
        f"embedding {size(r.embedding.total)}, head and loss {size(r.head.total)})",
        f"peak: {size(r.peak)} during the {r.peak_phase} ({peak_parts})",
        *(
            [
                f"reserved: {size(r.reserved)} at most over steady steps, {r.reserved / r.peak - 1:+.1%} on the peak "
                "(PyTorch's CUDA caching allocator replayed on the step's allocations: what the GPU must hold)"
            ]
            if r.reserved is not None
            else []
        ),
        *(
            [f"host memory: {size(r.host)} at most (what the offload layers save, copied out; not in the peak)"]
            if r.host
            else []
        ),
        "",
        _layer_table(r),
        "",
        _ops_table([last, r.embedding, r.head]),
        "",
        render_table(["phase", "largest total"], [[k, size(v)] for k, v in r.phases.items()]),
        *(f"note: {n}" for n in r.notes),
    ]
    return "\n".join(lines)

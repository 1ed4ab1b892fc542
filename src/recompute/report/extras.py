"""The report's optional sections: a plan file, bench results and a trace, read and checked against the model.

Each function returns a plain JSON-ready dict that the page embeds under ``sections``; bad input raises a
one-line ``ConfigError`` (unreadable file, not JSON, the wrong format, or made for another model).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recompute.core.analytic import Estimate, estimate, layer_activations
from recompute.core.errors import ConfigError, require
from recompute.core.identity import ModelId, spec_id
from recompute.core.plan import FORMAT
from recompute.core.plan_file import check_plan_dict
from recompute.core.policy import OFFLOAD_POLICIES, POLICIES, Policy
from recompute.core.results import read_bench, read_json
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload, build_workload

__all__ = [
    "TRACE_COMPONENTS",
    "bench_section",
    "describe_layers",
    "plan_section",
    "trace_section",
    "trace_workload",
]


def describe_layers(layers: list[str] | tuple[str, ...], loss: str = "full") -> str:
    """Counts of each policy, offloaded then most recomputing first: ``offload x2, block x23, mlp x7``; and the
    loss mode when it is chunked."""
    counts = Counter(layers)
    known = [*OFFLOAD_POLICIES, *reversed(list(POLICIES))]
    order = known + [name for name in counts if name not in known]
    text = ", ".join(f"{name} x{counts[name]}" for name in order if counts[name])
    return text + ("; chunked loss" if loss == "chunked" else "")


def _check_model(found: object, spec: ModelSpec, what: str, path: str | Path) -> None:
    """Refuse a plan for another model: by the hash of its architecture, by name in plans without one."""
    planned = ModelId.from_json(found)
    model = spec_id(spec)
    same = planned.same_model(model) if planned.hash else planned.name == spec.name
    this = model.describe() if planned.hash else repr(spec.name)
    require(
        same,
        f"{what} {str(path)!r} is for model {planned.describe()}, not {this}; "
        f"pass --model {planned.name} or make it with --model {spec.name}",
    )


def _plan_workload(data: dict[str, Any], path: str | Path) -> Workload:
    raw = data.get("workload")
    if not isinstance(raw, dict):
        raise ConfigError(f"plan file {str(path)!r} has no workload; make it with `recompute plan -o`")
    return build_workload(**raw)


PLAN_FORMATS = ("recompute.plan/1", FORMAT)
"""Plan files the report reads: the one planner's, and the format of the planners before it."""


def plan_section(path: str | Path, spec: ModelSpec) -> dict[str, Any]:
    """The plan per layer (policy and stored bytes) and its frontier, from a ``recompute plan -o`` file.

    Stored bytes per layer and the plan's predicted peak and overhead are recomputed here from the analytic
    model under the plan's own workload; the frontier and the uniform points are the planner's.

    Raises:
        ConfigError: unreadable file, not a plan, or a plan for another model (or layer count).
    """
    fix = "pass a file written by `recompute plan -o plan.json`"
    data = read_json(path, "plan file", fix)
    require(data.get("format") in PLAN_FORMATS, f"{str(path)!r} is not a recompute plan file; {fix}")
    try:
        check_plan_dict(data)
    except ConfigError as e:
        raise ConfigError(f"plan file {str(path)!r}: {e}") from None
    _check_model(data.get("model"), spec, "plan file", path)
    policy = Policy.from_dict(data)
    if policy.model is not None:
        _check_model(policy.model.to_dict(), spec, "the policy in plan file", path)
    wl = _plan_workload(data, path)
    layers = policy.per_layer(spec.n_layers)
    la = layer_activations(spec, wl)
    est = estimate(spec, wl, policy)
    point = lambda p: {"peak": float(p["peak"]), "overhead": float(p["overhead"])}  # noqa: E731
    try:
        frontier = [
            dict(point(p), plan=describe_layers(p.get("layers", []), p.get("loss", "full")))
            for p in data.get("frontier", [])
        ]
        uniform = {name: point(p) for name, p in data.get("uniform", {}).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"plan file {str(path)!r} has a malformed frontier ({e!r}); {fix}") from e
    return {
        "file": str(path),
        "model": spec.name,
        "workload": wl.to_dict(),
        "budget": float(data.get("budget", 0.0)),
        "cost_kind": str(data.get("cost_kind", "FLOPs")),
        "layers": list(layers),
        "stored": [la.stored(name) for name in layers],
        "peak": est.peak,
        "overhead": est.overhead,
        "describe": policy.describe(),
        "chosen": _chosen(data, est.peak, est.overhead),
        "frontier": frontier,
        "uniform": uniform,
    }


def _chosen(data: dict[str, Any], peak: float, overhead: float) -> dict[str, float]:
    """The plan's point on its frontier, in the frontier's cost units (FLOPs or measured seconds)."""
    predicted = data.get("predicted")
    if not isinstance(predicted, dict):
        predicted = {}
    return {"peak": float(predicted.get("peak", peak)), "overhead": float(predicted.get("overhead", overhead))}


def bench_section(path: str | Path, spec: ModelSpec) -> dict[str, Any]:
    """Measured peak memory and step time per policy from a ``recompute bench --json`` result (``read_bench``),
    next to what the bench predicted for the same workload. The measured overhead is each policy's step time
    over the ``none`` step time, minus one.

    Raises:
        ConfigError: unreadable file, not a bench result, or results for another model.
    """
    result = read_bench(path, model=spec.name)
    base = result.step_times().get("none")
    rows = [
        {
            "policy": row.policy,
            "measured_peak": float(row.peak),
            "predicted_peak": row.predicted_peak,
            "step_time_s": row.step_s,
            "measured_overhead": row.step_s / base - 1 if base else None,
            "predicted_overhead": row.predicted_overhead,
        }
        for row in result.rows
    ]
    wl = build_workload(**result.workload)
    return {"file": str(path), "model": spec.name, "device": result.device, "workload": wl.to_dict(), "rows": rows}


TRACE_COMPONENTS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer",
    "attention": "attention",
    "mlp": "MLP",
    "norms": "norms",
    "checkpoint": "checkpoints",
    "other": "other (in a layer)",
    "embedding": "embedding",
    "head": "head and loss",
    "peak": "peak",
}
"""What the trace section compares, key -> label."""
_LAYER_PARTS = ("attention", "mlp", "norms", "checkpoint", "other")  # recompute.trace.COMPONENTS


def trace_workload(wl: Workload, *, cuda: bool) -> Workload:
    """The workload the trace runs and the analytic side is computed for: one rank (no parallelism), the CPU
    unless CUDA is there, and parameters, gradients and AdamW state in the activation dtype, as the trace
    keeps them (``bf16`` precision mode: 2 + 2 + 4 bytes per parameter; ``fp32``: 4 + 4 + 8)."""
    return dataclasses.replace(
        wl,
        tp=1,
        sp=False,
        pp=1,
        interleave=1,
        n_microbatches=None,
        dp=1,
        device=wl.device if cuda else "cpu",
        precision="fp32" if wl.dtype == "fp32" else "bf16",
    )


def _analytic_parts(est: Estimate) -> dict[str, float]:
    act, st = est.activations, est.states
    return {
        "parameters": st.parameters,
        "gradients": st.gradients,
        "optimizer": st.optimizer,
        **{k: act.get(k, 0.0) for k in ("attention", "mlp", "norms", "checkpoint", "embedding")},
        "other": 0.0,
        "head": act.get("head", 0.0) + act.get("logits", 0.0),
        "peak": est.peak,
    }


def _traced_parts(result: Any) -> dict[str, float]:
    layers = {c: float(sum(p.components.get(c, 0) for p in result.layers)) for c in _LAYER_PARTS}
    return {
        "parameters": result.parameters,
        "gradients": result.gradients,
        "optimizer": result.optimizer,
        **layers,
        "embedding": result.embedding.total,
        "head": result.head.total,
        "peak": result.peak,
    }


def trace_section(
    spec: ModelSpec,
    wl: Workload,
    *,
    trace: Callable[..., Any],
    policies: tuple[str, ...] = tuple(POLICIES),
    layers: int | None = 2,
) -> dict[str, Any]:
    """Trace one step of ``spec`` per policy (``recompute.trace``, fake tensors) next to the analytic bytes.

    ``trace`` is ``recompute.trace.trace`` (the caller loads torch). ``layers`` traced layers (and one more) are
    scaled to the model's; ``None`` traces them all.

    Raises:
        ConfigError: the trace cannot run this model or workload.
    """
    import torch

    twl = trace_workload(wl, cuda=torch.cuda.is_available())
    scaled = layers if layers is not None and layers < spec.n_layers - 1 else None
    rows: dict[str, Any] = {}
    notes: tuple[str, ...] = ()
    seconds = 0.0
    for policy in policies:
        result = trace(spec, twl, policy, layers=scaled)
        rows[policy] = {"analytic": _analytic_parts(estimate(spec, twl, policy)), "traced": _traced_parts(result)}
        notes, seconds = result.notes, seconds + result.seconds
    return {
        "model": spec.name,
        "seq_len": twl.seq_len,
        "workload": twl.to_dict(),
        "components": dict(TRACE_COMPONENTS),
        "policies": rows,
        "notes": list(notes),
        "seconds": seconds,
    }

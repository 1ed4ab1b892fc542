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
from recompute.core.presets import PRESETS
from recompute.core.results import read_bench, read_json
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload, build_workload

__all__ = [
    "TRACE_COMPONENTS",
    "bench_section",
    "describe_layers",
    "plan_section",
    "plan_view",
    "read_plan_file",
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


def _check_model(found: object, model: ModelSpec | ModelId, what: str, path: str | Path) -> None:
    """Refuse a plan for another model: by the hash of its architecture, by name in plans without one."""
    planned = ModelId.from_json(found)
    mine = spec_id(model) if isinstance(model, ModelSpec) else model
    same = planned.same_model(mine) if planned.hash and mine.hash else planned.name == mine.name
    this = mine.describe() if planned.hash and mine.hash else repr(mine.name)
    fix = (
        f"pass --model {planned.name} or make it with --model {mine.name}"
        if planned.name in PRESETS and mine.name in PRESETS
        else "pass the --model it was made for, or make one for this model with recompute plan -o"
    )  # a config's name is its file's stem: --model qwen2 would name no model
    require(same, f"{what} {str(path)!r} is for model {planned.describe()}, not {this}; {fix}")


def _plan_workload(data: dict[str, Any], path: str | Path) -> Workload:
    raw = data.get("workload")
    if not isinstance(raw, dict):
        raise ConfigError(f"plan file {str(path)!r} has no workload; make it with `recompute plan -o`")
    return build_workload(**raw)


PLAN_FORMATS = ("recompute.plan/1", FORMAT)
"""Plan files the report reads: the one planner's, and the format of the planners before it."""
_FIX = "pass a file written by `recompute plan -o plan.json`"


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """A plan file's dict, checked (``check_plan_dict``) before anything slow runs.

    Raises:
        ConfigError: unreadable file, not JSON, or not a plan.
    """
    data = read_json(path, "plan file", _FIX)
    require(data.get("format") in PLAN_FORMATS, f"{str(path)!r} is not a recompute plan file; {_FIX}")
    try:
        check_plan_dict(data)
    except ConfigError as e:
        raise ConfigError(f"plan file {str(path)!r}: {e}") from None
    return data


def plan_section(path: str | Path, model: ModelSpec | ModelId) -> dict[str, Any]:
    """The plan per layer (policy and stored bytes) and its frontier, from a ``recompute plan -o`` file.

    For a preset (``model`` a ``ModelSpec``) the stored bytes per layer and the plan's predicted peak and overhead
    are recomputed here from the analytic model under the plan's own workload; for a profiled model (``model``
    its ``ModelId``, by name and architecture hash) they are the file's own, as its profile predicted them. The
    frontier and the uniform points are the planner's.

    Raises:
        ConfigError: unreadable file, not a plan, or a plan for another model (or layer count).
    """
    data = read_plan_file(path)
    _check_model(data.get("model"), model, "plan file", path)
    policy = Policy.from_dict(data)
    if policy.model is not None:
        _check_model(policy.model.to_dict(), model, "the policy in plan file", path)
    wl = _plan_workload(data, path)
    name = model.name
    if not isinstance(model, ModelSpec):
        return plan_view(data, file=str(path), model=name)
    view = plan_view(data, file=str(path), model=name, n_layers=model.n_layers)
    layers = view["layers"]
    la = layer_activations(model, wl)
    est = estimate(model, wl, policy)
    view.update(stored=[la.stored(p) for p in layers], peak=est.peak, overhead=est.overhead, stored_by="analytic")
    view["chosen"] = _chosen(data, est.peak, est.overhead)
    return view


def plan_view(
    data: dict[str, Any], *, file: str, model: str, n_layers: int | None = None, budget: float | None = None
) -> dict[str, Any]:
    """The plan section of a plan file's dict (``Plan.to_dict``) as its planner predicted it: the policy and the
    bytes saved of each layer, the plan's point, the frontier and the uniform points (``budget``: the file's
    unless given).

    Raises:
        ConfigError: a malformed frontier, or a policy that does not list ``n_layers`` layers.
    """
    policy = Policy.from_dict(data)
    layers = policy.per_layer(n_layers if n_layers is not None else len(policy.layers or ()))
    found = data.get("predicted")
    predicted: dict[str, Any] = found if isinstance(found, dict) else {}
    kept = [float(b) for b in predicted.get("kept", [])]
    point = lambda p: {"peak": float(p["peak"]), "overhead": float(p["overhead"])}  # noqa: E731
    try:
        frontier = [
            dict(point(p), plan=describe_layers(p.get("layers", []), p.get("loss", "full")))
            for p in data.get("frontier", [])
        ]
        uniform = {name: point(p) for name, p in data.get("uniform", {}).items()}
        chosen = point(predicted) if predicted else None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"plan file {file!r} has a malformed frontier ({e!r}); {_FIX}") from e
    return {
        "file": file,
        "model": model,
        "workload": dict(data.get("workload") or {}),
        "budget": float(budget if budget is not None else data.get("budget", 0.0)),
        "cost_kind": str(data.get("cost_kind", "FLOPs")),
        "layers": list(layers),
        "stored": (kept * -(-len(layers) // len(kept)))[: len(layers)] if kept else [],  # one stage, repeated
        "stored_by": "as its planner predicted it",
        "peak": chosen["peak"] if chosen else None,
        "overhead": chosen["overhead"] if chosen else None,
        "describe": policy.describe(),
        "chosen": chosen,
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
    next to what the bench predicted for the same workload (for steps run ``torch.compile``d, ``compiled`` says
    how, and the prediction is the compiled step's trace). The measured overhead is each policy's step time over
    the ``none`` step time, minus one.

    Raises:
        ConfigError: unreadable file, not a bench result, or results for another model.
    """
    result = read_bench(path, model=spec.name)
    base = result.step_times().get("none")
    losses = len({r.loss for r in result.rows}) > 1  # bench --loss-modes: name each row's
    rows = [
        {
            "policy": f"{row.policy}, {row.loss} loss" if losses else row.policy,
            "loss": row.loss,
            "measured_peak": float(row.peak),
            "predicted_peak": row.predicted_peak,
            "step_time_s": row.step_s,
            "measured_overhead": row.step_s / base - 1 if base else None,
            "predicted_overhead": row.predicted_overhead,
        }
        for row in result.rows
    ]
    wl = build_workload(**result.workload)
    return {
        "file": str(path),
        "model": spec.name,
        "device": result.device,
        "workload": wl.to_dict(),
        "rows": rows,
        "compiled": result.compiled,
        "memory_budget": result.memory_budget,
    }


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

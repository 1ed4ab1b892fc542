"""The charts of a model planned from its profile (a config.json, a factory): what the page draws when the
analytic model does not read the model.

The analytic charts sweep the sequence length with formulas held to presets; a profiled model is measured at one
workload (``recompute.trace.profile``), so its charts are of that workload: the memory of each uniform policy and
of the plan by component against the budget, the plan layer by layer, and the planner's frontier. Every figure is
the profile's or the one planner's (``recompute.core.plan``). Torch-free, plotly-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recompute.core.costs import CostTable
from recompute.core.plan import Plan
from recompute.core.profile import Profile
from recompute.report.extras import plan_view

__all__ = ["MEASURED_COMPONENTS", "profile_components", "profile_section"]

MEASURED_COMPONENTS: dict[str, str] = {
    "parameters": "Parameters",
    "optimizer": "Optimizer",
    "buffers": "Buffers, other state",
    "outside": "Embedding, head, logits",
    "checkpoint": "Checkpoints",
    "norms": "Norms",
    "mlp": "MLP",
    "attention": "Attention",
    "other": "Other (in a layer)",
}
"""Stacked from the bottom up, as the analytic memory chart, less the gradients: what is alive when the backward
starts (the gradients come in the backward as the activations go; the peak, measured, is drawn apart).
``other`` holds what the layers share."""


def profile_components(prof: Profile, layers: Sequence[str]) -> dict[str, float]:
    """What is alive when the backward of a per-layer assignment of ``prof``'s layers starts, by
    ``MEASURED_COMPONENTS``: the parameters, the optimizer state and the buffers, then the bytes saved for the
    backward. Sums to those and ``prof.activations(layers)``.

    What the layers share (the first layer keeps it, ``Profile.base_kept``) is counted in ``other``.
    """
    parts = dict.fromkeys(("checkpoint", "norms", "mlp", "attention", "other"), 0.0)
    for i, name in enumerate(layers):
        for component, saved in prof.kind_of(i).components[name].items():
            parts[component if component in parts else "other"] += saved
    parts["other"] += sum(prof.base_kept) - sum(prof.kind_of(i).kept["none"] for i in range(prof.n_layers))
    return {
        "parameters": float(prof.parameters),
        "optimizer": float(prof.optimizer),
        "buffers": float(prof.other),
        "outside": float(prof.embedding_kept + prof.head_kept),
        **parts,
    }


def _bar(name: str, prof: Profile, table: CostTable, layers: Sequence[str], budget: float) -> dict[str, Any]:
    c = table.compose(layers)
    parts = profile_components(prof, layers)
    return {"name": name, "components": parts, "peak": c.peak, "peak_phase": c.peak_phase, "fits": c.peak <= budget}


def profile_section(
    result: Plan,
    profiles: Sequence[Profile],
    tables: Sequence[CostTable],
    *,
    budget: float,
    chosen: bool = True,
) -> dict[str, Any]:
    """The charts of a profiled model from the one planner's ``result`` over ``tables`` (one per loss mode, made
    from ``profiles`` in the same order).

    Args:
        budget: the page's budget (the memory chart's line).
        chosen: whether ``result`` is the page's answer; False when nothing fits and ``result`` is the plan under
            no budget, drawn only for its frontier and uniform policies.

    Returns:
        A JSON-ready dict: ``components`` (key -> label), ``bars`` (each uniform policy, then the plan), and
        ``plan``, the plan per layer and its frontier in the shape of ``report.extras.plan_section``.
    """
    base, prof = tables[0], profiles[0]
    bars = [_bar(o, prof, base, (o,) * base.n, budget) for o in base.options()]
    if chosen:
        i = next(i for i, t in enumerate(tables) if t.workload["loss"] == result.loss)
        name = "the plan" + ("; chunked loss" if result.loss == "chunked" else "")
        bars.append(_bar(name, profiles[i], tables[i], result.chosen.layers, budget))
    view = plan_view(result.to_dict(), file="", model=result.model, budget=budget)
    return {
        "model": result.model,
        "workload": dict(base.workload),
        "budget": budget,
        "source": base.source,
        "components": dict(MEASURED_COMPONENTS),
        "bars": bars,
        "chosen": chosen,
        "plan": view if chosen else {**view, "chosen": None},
    }

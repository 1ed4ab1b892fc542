"""The report's first screen: what fits the GPU, the plan that does it, its peak against the budget, its time
cost, and the line that applies it. Built from the one planner's ``Plan`` (or its refusal); plain data, then
static HTML (no chart: it reads before any script runs).
"""

from __future__ import annotations

import json
from collections import Counter
from html import escape
from typing import Any
from urllib.parse import quote

from recompute.core.plan import Plan, PlanPoint
from recompute.core.policy import OFFLOAD_POLICIES, POLICIES
from recompute.core.table import gib

__all__ = ["answer_data", "answer_html"]

_ORDER = (*OFFLOAD_POLICIES, *reversed(list(POLICIES)))


def _counts(layers: tuple[str, ...] | list[str]) -> str:
    counts = Counter(layers)
    return ", ".join(f"{n} x{counts[n]}" for n in dict.fromkeys([*_ORDER, *counts]) if counts.get(n))


def _point(p: PlanPoint, tokens: int) -> dict[str, Any]:
    return {
        "peak": p.peak,
        "overhead": p.overhead,
        "step_seconds": p.step_seconds,
        "tokens_per_second": tokens / p.step_seconds if p.step_seconds else None,
        "plan": _counts(p.layers) + ("; chunked loss" if p.loss == "chunked" else ""),
    }


def answer_data(
    plan: Plan | None, *, budget: float, gpu: str, usable: float, command: str, refusal: str | None = None
) -> dict[str, Any]:
    """What the first screen says: the plan (or why nothing fits), against ``budget`` on ``gpu``.

    Args:
        command: the ``recompute plan`` command that gives the same plan (written to a file).
        refusal: the planner's one-line reason when nothing fits.
    """
    out: dict[str, Any] = {"budget": budget, "gpu": gpu, "usable": usable, "command": command, "refusal": refusal}
    if plan is None:
        return out
    apply = "recompute.apply(model, 'plan.json'" + (", loss='chunked')" if plan.loss == "chunked" else ")")
    others = [p for p in (plan.frontier[0], plan.frontier[-1]) if p != plan.chosen]
    out.update(
        chosen=_point(plan.chosen, plan.tokens),
        layers=list(plan.layers),
        loss=plan.loss,
        host=plan.host,
        cost_kind=plan.cost_kind,
        timed=plan.timed,
        flop_overhead=plan.recompute_flops / plan.model_flops if plan.model_flops else 0.0,
        peak_phase=plan.peak_phase,
        apply=apply,
        plan_file=plan.to_dict(),
        others=[_point(p, plan.tokens) for p in others],
        uniform={n: _point(p, plan.tokens) for n, p in plan.uniform.items()},
        source=plan.source,
    )
    return out


def _refused(reason: str) -> str:
    """The planner's reason as one sentence: ``No plan fits 40.0 GiB: ...``; another reason is said to be why
    nothing fits (the page read "Nothing fits. no plan fits 40.0 GiB: ...", issue 36)."""
    text = reason.strip().rstrip(".")
    if not text.lower().startswith(("no plan fits", "nothing fits")):
        text = f"nothing fits: {text}"
    return text[:1].upper() + text[1:] + "."


def answer_html(a: dict[str, Any]) -> str:
    """The answer as a static block, first on the page."""
    head = f"What fits {escape(a['gpu'])}: budget {gib(a['budget'])} per GPU"
    if a.get("refusal"):
        return (
            f"<section id='answer' class='answer none'><h2>{head}</h2><p class='verdict'>"
            f"{escape(_refused(a['refusal']))}</p>"
            f"<p>Plan it yourself: <code>{escape(a['command'])}</code></p></section>"
        )
    c = a["chosen"]
    used = min(1.0, c["peak"] / a["budget"]) if a["budget"] else 1.0
    cost = (
        f"{100 * c['overhead']:+.1f} % predicted step time ({c['step_seconds'] * 1e3:,.1f} ms, "
        f"{c['tokens_per_second']:,.0f} tokens/s)"
        if a["timed"] and c["step_seconds"]
        else f"{100 * c['overhead']:.1f} % of the step's FLOPs recomputed"
    )
    extras = []
    if a["loss"] == "chunked":
        extras.append("the chunked loss (the logits never all alive; nothing replayed)")
    if a["host"]:
        extras.append(f"offload: {gib(a['host'])} of pinned host memory per GPU")
    download = "data:application/json," + quote(json.dumps(a["plan_file"]))
    rows = "".join(
        f"<tr><td>{escape(name)}</td><td>{gib(p['peak'])}</td><td>{_cost(p, a['timed'])}</td>"
        f"<td>{'yes' if p['peak'] <= a['budget'] else 'no'}</td></tr>"
        for name, p in a["uniform"].items()
    )
    return (
        f"<section id='answer' class='answer'><h2>{head}</h2>"
        f"<p class='verdict'><b id='answer-plan'>{escape(c['plan'])}</b></p>"
        f"<div class='meter'><div style='width:{100 * used:.1f}%'></div></div>"
        f"<p id='answer-peak'>predicted peak <b>{gib(c['peak'])}</b> of {gib(a['budget'])} "
        f"({escape(a['peak_phase'])}); {escape(a['gpu'])} has {gib(a['usable'])} usable</p>"
        f"<p id='answer-cost'>cost: <b>{cost}</b>"
        + (f"; {100 * a['flop_overhead']:.1f} % more FLOPs" if a["timed"] else "")
        + "</p>"
        + (f"<p>with {'; '.join(escape(e) for e in extras)}</p>" if extras else "")
        + f"<p>apply it: <code id='answer-apply'>{escape(a['apply'])}</code> "
        f"(<a download='plan.json' href='{download}'>plan.json</a>; or "
        f"<code>{escape(a['command'])}</code>)</p>"
        f"<details><summary>every layer alike, for comparison</summary><table><thead><tr><th>policy</th>"
        f"<th>peak</th><th>cost</th><th>fits</th></tr></thead><tbody>{rows}</tbody></table></details>"
        f"<p class='source'>{escape(a['source'])}; costs in {escape(a['cost_kind'])}</p></section>"
    )


def _cost(p: dict[str, Any], timed: bool) -> str:
    return f"{100 * p['overhead']:+.1f} % time" if timed else f"{100 * p['overhead']:.1f} % FLOPs"

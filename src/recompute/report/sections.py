"""The optional sections (trace, bench, plan): each an HTML outline and the script that draws it.

Each ``html`` takes the section's dict (from ``report.extras``) and returns a ``<section>`` with empty chart
containers; each ``script`` pushes a drawer onto ``window.RECOMPUTE`` (see ``assets.PAGE_JS``): onto
``drawers`` when it follows the buttons, onto ``once`` when it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

from recompute.core.table import gib

__all__ = ["SECTIONS", "Section", "section"]


def section(ident: str, title: str, caption: str, inner: str) -> str:
    """A ``<section id="s-IDENT">`` with a title, a caption (HTML, already escaped) and its inner HTML."""
    return f"<section id='s-{ident}'><h2>{escape(title)}</h2><p class='caption'>{caption}</p>{inner}</section>"


def _pair(left: str, right: str) -> str:
    charts = "".join(f"<div id='{ident}' class='chart small'></div>" for ident in (left, right))
    return f"<div class='pair'>{charts}</div>"


def _plan_html(data: dict[str, Any]) -> str:
    w = data["workload"]
    caption = (
        f"From <code>{escape(data['file'])}</code>: {escape(data['describe'])} at s = {w['seq_len']}, "
        f"b = {w['micro_batch']}, {escape(w['attention'])} attention, budget {gib(data['budget'])} "
        f"(cost in {escape(data['cost_kind'])}). Left: the policy of each layer and the bytes it stores "
        f"({escape(data.get('stored_by', 'analytic'))}). "
        "Right: the planner's Pareto frontier of predicted peak against recompute overhead, the uniform policies, "
        "and the plan."
    )
    return section("plan", "The plan, layer by layer, and its frontier", caption, _pair("plan-layers", "plan-frontier"))


_PLAN_JS = """
(function (R) {
  R.once.push(() => R.drawPlan(R.data.sections.plan, "plan-layers", "plan-frontier"));
})(window.RECOMPUTE);
"""


def _profile_html(data: dict[str, Any]) -> str:
    w = data["workload"]
    mine = data["chosen"]
    caption = (
        f"{escape(data['model'])} at s = {w['seq_len']}, b = {w['micro_batch']}, {escape(str(w['dtype']))}, as its "
        f"profile measured it ({escape(data['source'])}). What each policy "
        + ("and the plan " if mine else "")
        + "keep when the backward starts, by component (the gradients come in the backward, as the activations "
        f"go), against the budget of {gib(data['budget'])}; ◆ the step's predicted peak (its phase on hover); "
        + ("the plan layer by layer; " if mine else "")
        + "the planner's Pareto frontier of predicted peak against recompute overhead. The analytic model's charts, "
        "which sweep the sequence length, are drawn for presets."
    )
    charts = "<div id='profile-memory' class='chart'></div>" + (
        _pair("profile-layers", "profile-frontier") if mine else "<div id='profile-frontier' class='chart small'></div>"
    )
    return section("profile", "Memory and the plan, from the model's profile", caption, charts)


_PROFILE_JS = """
(function (R) {
  R.once.push(function drawProfile() {
    const d = R.data.sections.profile, x = d.bars.map((b) => b.name), keys = Object.keys(d.components);
    const traces = keys.map((k) => ({
      type: "bar", name: d.components[k], x: x, y: d.bars.map((b) => R.gib(b.components[k])),
      marker: { color: R.COLORS[k] }, hovertemplate: R.hover(".3g", d.components[k]) + " GiB",
    }));
    traces.push({ type: "scatter", mode: "markers", name: "predicted peak", x: x, y: d.bars.map((b) => R.gib(b.peak)),
      text: d.bars.map((b) => b.peak_phase), marker: { symbol: "diamond", size: 10, color: "#111" },
      hovertemplate: "%{y:.3g} GiB in %{text}<extra>peak</extra>" });
    traces.push(R.hline(x, d.budget, "budget", "dash"));
    const extra = { barmode: "stack", xaxis: { title: { text: "policy" }, type: "category" },
      legend: { orientation: "v", x: 1.02, y: 1, traceorder: "reversed" } };
    const title = "Memory by component against the budget: " + d.model;
    Plotly.react("profile-memory", traces, R.layout(title, "GiB per GPU", extra), R.CONFIG);
    R.drawPlan(d.plan, d.chosen ? "profile-layers" : null, "profile-frontier");
  });
})(window.RECOMPUTE);
"""


def _bench_html(data: dict[str, Any]) -> str:
    how = "the prediction for the same workload"
    compiled = data.get("compiled")
    if compiled:
        budget = data.get("memory_budget")
        what = "each block" if compiled == "block" else "the whole model"
        knob = f"activation_memory_budget {budget:g}" if budget is not None else "PyTorch's memory budget"
        how = f"the compiled step's trace (steps run torch.compile'd: {what}, {knob})"
    caption = (
        f"From <code>{escape(data['file'])}</code> ({escape(data['device'] or 'device not recorded')}): measured "
        f"peak memory and step-time overhead of each policy next to {escape(how)}."
    )
    return section("bench", "Measured against predicted", caption, _pair("bench-memory", "bench-time"))


_BENCH_JS = """
(function (R) {
  R.once.push(function drawBench() {
    const rows = R.data.sections.bench.rows, x = rows.map((r) => r.policy), bar = (name, y, color) =>
      ({ type: "bar", name: name, x: x, y: y, marker: { color: color }, hovertemplate: R.hover(".3g", name) });
    const axis = { xaxis: { title: { text: "policy" }, type: "category" }, barmode: "group" };
    Plotly.react("bench-memory", [
      bar("measured peak", rows.map((r) => (r.measured_peak === null ? null : R.gib(r.measured_peak))), "#2f6fde"),
      bar("predicted peak", rows.map((r) => R.gib(r.predicted_peak)), "#b3b3b3"),
    ], R.layout("Peak memory per policy", "GiB", axis), R.CONFIG);
    Plotly.react("bench-time", [
      bar("measured overhead", rows.map((r) => (r.measured_overhead === null ? null : 100 * r.measured_overhead)),
          "#d95f02"),
      bar("predicted overhead (FLOPs)", rows.map((r) => 100 * r.predicted_overhead), "#b3b3b3"),
    ], R.layout("Step-time overhead against none", "overhead (%)", axis), R.CONFIG);
  });
})(window.RECOMPUTE);
"""


def _trace_html(data: dict[str, Any]) -> str:
    w = data["workload"]
    caption = (
        f"<code>recompute.trace</code> ran the real training step of {escape(data['model'])} at s = {w['seq_len']}, "
        f"one rank, {escape(w['dtype'])} states ({escape('; '.join(data['notes']))}). Its bytes by component, next to "
        "the analytic bytes for the same workload. Follows the policy buttons."
    )
    return section("trace", "Traced bytes against the analytic model", caption, "<div id='trace' class='chart'></div>")


_TRACE_JS = """
(function (R) {
  R.drawers.push(function drawTrace() {
    const t = R.data.sections.trace, keys = Object.keys(t.components);
    const row = t.policies[R.state.policy] || { analytic: {}, traced: {} };
    const x = keys.map((k) => t.components[k]);
    const bar = (name, values, color) => ({ type: "bar", name: name, x: x, y: keys.map((k) => R.gib(values[k] || 0)),
      marker: { color: color }, hovertemplate: R.hover(".4g", name) + " GiB" });
    const yaxis = { type: "log", title: { text: "GiB (log)" } };
    const extra = { xaxis: { type: "category" }, yaxis: yaxis, barmode: "group" };
    const title = t.policies[R.state.policy] ? "Traced against analytic: " + t.model + ", policy " + R.state.policy +
      ", s = " + t.seq_len : "Policy " + R.state.policy + " was not traced";
    Plotly.react("trace", [bar("analytic", row.analytic, "#b3b3b3"), bar("traced", row.traced, "#2f6fde")],
      R.layout(title, "", extra), R.CONFIG);
  });
})(window.RECOMPUTE);
"""


@dataclass(frozen=True)
class Section:
    """One optional section: its HTML outline and its drawing script."""

    html: Callable[[dict[str, Any]], str]
    script: str


SECTIONS: dict[str, Section] = {
    "profile": Section(_profile_html, _PROFILE_JS),
    "trace": Section(_trace_html, _TRACE_JS),
    "bench": Section(_bench_html, _BENCH_JS),
    "plan": Section(_plan_html, _PLAN_JS),
}
"""Section name (a key of ``Report.sections``) -> its outline and script, in page order; ``profile`` is the
charts of a model the analytic model does not read (``report.measured``)."""

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
        f"(cost in {escape(data['cost_kind'])}). Left: the policy of each layer and the bytes it stores (analytic). "
        "Right: the planner's Pareto frontier of predicted peak against recompute overhead, the uniform policies, "
        "and the plan."
    )
    return section("plan", "The plan, layer by layer, and its frontier", caption, _pair("plan-layers", "plan-frontier"))


_PLAN_JS = """
(function (R) {
  R.once.push(function drawPlan() {
    const plan = R.data.sections.plan, idx = plan.layers.map((_, i) => i);
    const bars = Object.keys(R.data.policies).filter((p) => plan.layers.includes(p)).map((p) => {
      const mine = idx.filter((i) => plan.layers[i] === p);
      return { type: "bar", name: p, x: mine, y: mine.map((i) => R.gib(plan.stored[i])),
               marker: { color: R.POLICY_COLORS[p] }, hovertemplate: "layer %{x}: " + R.hover(".3f", p) };
    });
    const left = { xaxis: { title: { text: "layer" } }, barmode: "overlay" };
    const leftTitle = "Policy and stored bytes per layer: " + plan.model;
    Plotly.react("plan-layers", bars, R.layout(leftTitle, "GiB", left), R.CONFIG);
    const f = plan.frontier, u = Object.keys(plan.uniform), c = plan.chosen;
    const traces = [
      { type: "scatter", mode: "lines+markers", name: "frontier", x: f.map((p) => R.gib(p.peak)),
        y: f.map((p) => 100 * p.overhead), text: f.map((p) => p.plan), line: { color: "#7570b3", shape: "hv" },
        hovertemplate: "%{x:.2f} GiB, +%{y:.1f} %<br>%{text}<extra>frontier</extra>" },
      { type: "scatter", mode: "markers+text", name: "uniform policies", x: u.map((n) => R.gib(plan.uniform[n].peak)),
        y: u.map((n) => 100 * plan.uniform[n].overhead), text: u, textposition: "top center",
        marker: { color: "#999", size: 8 } },
      { type: "scatter", mode: "markers", name: "the plan", x: [R.gib(c.peak)], y: [100 * c.overhead],
        marker: { symbol: "star", size: 16, color: "#d95f02" } },
    ];
    const budget = R.gib(plan.budget), dash = { color: "#c0392b", dash: "dash" };
    const line = { type: "line", yref: "paper", x0: budget, x1: budget, y0: 0, y1: 1, line: dash };
    const shapes = plan.budget > 0 ? [line] : [];
    const right = { xaxis: { title: { text: "predicted peak (GiB)" } }, shapes: shapes };
    const title = "Frontier: predicted peak against overhead (dashed: budget)";
    Plotly.react("plan-frontier", traces, R.layout(title, "recompute overhead (%)", right), R.CONFIG);
  });
})(window.RECOMPUTE);
"""


def _bench_html(data: dict[str, Any]) -> str:
    caption = (
        f"From <code>{escape(data['file'])}</code> ({escape(data['device'] or 'device not recorded')}): measured "
        "peak memory and step-time overhead of each policy next to the analytic prediction for the same workload."
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
    "trace": Section(_trace_html, _TRACE_JS),
    "bench": Section(_bench_html, _BENCH_JS),
    "plan": Section(_plan_html, _PLAN_JS),
}
"""Section name (a key of ``Report.sections``) -> its outline and script, in page order."""

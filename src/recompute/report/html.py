"""``render_html``: the report as one self-contained HTML page (plotly.js, data and script all inlined).

The page is an outline of sections with empty chart containers; the numbers travel once, as the JSON block
``<script type="application/json" id="data">`` (``Report.to_dict``), and the inline script draws from it. Only
the worked example, whose numbers never change with the buttons, is written out here as a table.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from recompute.core import __version__
from recompute.core.table import gib
from recompute.report.answer import answer_html
from recompute.report.assets import PAGE_CSS, PAGE_JS, START_JS
from recompute.report.data import Report, WorkedExample
from recompute.report.sections import SECTIONS, section

__all__ = ["embed_json", "render_html"]


def embed_json(data: Any) -> str:
    """``data`` as JSON safe inside a ``<script>`` element (no ``</`` sequence, no NaN)."""
    return json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def render_html(report: Report, *, plotly_js: str | None = None) -> str:
    """The whole page as a string; writes nothing.

    Args:
        report: what ``build_report`` computed.
        plotly_js: the plotly.js bundle to inline; by default ``plotly.offline.get_plotlyjs()``.

    Raises:
        ImportError: plotly is not installed and no bundle was given.
    """
    title = f"Activation recomputation: {report.model}"
    present = [name for name in SECTIONS if name in report.sections]
    if plotly_js is None:  # a page with no chart (the answer alone) goes without the 4.8 MB bundle
        from plotly.offline import get_plotlyjs

        plotly_js = get_plotlyjs() if report.models or present else ""
    script = PAGE_JS + "".join(SECTIONS[name].script for name in present) + START_JS
    if report.models:
        charts = [_controls(report), _cards(), *_analytic_sections(report)]
    else:
        charts = [] if "profile" in present else [_no_charts(report)]
    body = "\n".join(
        [
            f"<header><h1>{escape(title)}</h1><p class='sub'>{escape(_workload_line(report))}</p></header>",
            "<main>",
            *([answer_html(report.answer)] if report.answer else []),
            *charts,
            *(SECTIONS[name].html(report.sections[name]) for name in present),
            "</main>",
            _footer(report),
        ]
    )
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{escape(title)}</title><style>{PAGE_CSS}</style></head>\n<body>\n{body}\n"
        f"<script>{plotly_js}</script>\n"
        f"<script type='application/json' id='data'>{embed_json(report.to_dict())}</script>\n"
        f"<script>{script}</script>\n</body></html>\n"
    )


def _no_charts(report: Report) -> str:
    return section(
        "charts",
        "The workshop's charts",
        f"They sweep the sequence length with the analytic model, which is not drawn here: {escape(report.analytic)}. "
        "The answer above comes from the model's own profile, measured at this workload.",
        "",
    )


def _workload_line(report: Report) -> str:
    w = report.workload
    parallel = f"t={w['tp']}{' + sp' if w['sp'] else ''}, p={w['pp']}, d={w['dp']}"
    return (
        f"micro-batch {w['micro_batch']}, {w['dtype']} activations on {w['device']}, {w['precision']} precision, "
        f"{parallel}; the charts from {_charts_source(report)}"
    )


def _charts_source(report: Report) -> str:
    if report.models:
        return "recompute's analytic model"
    return "the model's profile" if "profile" in report.sections else "nowhere: the answer alone"


def _buttons(key: str, label: str, options: dict[str, str]) -> str:
    buttons = "".join(
        f"<button type='button' data-set='{key}' data-value='{escape(value)}'>{escape(text)}</button>"
        for value, text in options.items()
    )
    return f"<div class='group' id='set-{key}'><span>{escape(label)}</span>{buttons}</div>"


def _controls(report: Report) -> str:
    models = {name: f"{name} ({s.params / 1e9:.3g}B)" for name, s in report.models.items()}
    return (
        "<div class='controls'>"
        + "".join(
            [
                _buttons("model", "Model size", models),
                _buttons("policy", "Policy", {p: p for p in report.policies}),
                _buttons("attention", "Attention", {"eager": "eager", "flash": "flash"}),
                _buttons("scale", "Memory axis", {"linear": "linear", "log": "log"}),
            ]
        )
        + "</div>"
    )


def _cards() -> str:
    cards = [
        ("card-params", "parameters"),
        ("card-states", "parameters + gradients + optimizer"),
        ("card-stored", ""),
        ("card-attn", "of the activations saved by recomputing attention (A)"),
        ("card-block", "saved by recomputing whole layers (block)"),
        ("card-long", ""),
    ]
    return (
        "<div class='cards'>"
        + "".join(
            f"<div class='card'><b id='{i}'>–</b><span id='{i}-label'>{escape(text)}</span></div>" for i, text in cards
        )
        + "</div>"
    )


def _analytic_sections(report: Report) -> list[str]:
    gpu = report.gpu
    return [
        section(
            "memory",
            "Training memory breakdown",
            "Model states (parameters, gradients, optimizer) and the activations stored at the end of the forward, "
            "by component, for the chosen policy. ◆ is the predicted peak: it adds the loss gradients or the "
            f"activations a recomputed layer brings back during its backward. Red lines: {escape(gpu.label)}'s "
            "memory and what is usable after the CUDA context and a fragmentation allowance.",
            "<div id='memory' class='chart'></div>",
        ),
        section(
            "overhead",
            "Compute overhead against sequence length",
            "Recomputed forward FLOPs over the model FLOPs of the step (3F, logits included); hover for the "
            "workshop's per-layer F<sub>recomputed</sub> / 3F. Attention's share grows with s (its 4bs²h term).",
            "<div id='overhead' class='chart small'></div>",
        ),
        section(
            "savings",
            "Memory saved per % of compute overhead",
            "<span id='savings-caption'></span>",
            "<table><thead><tr><th>policy</th><th>memory saved</th><th>compute overhead</th>"
            "<th>saved per 1 % overhead</th><th>time overhead (predicted)</th></tr></thead>"
            "<tbody id='savings-body'></tbody></table>"
            "<p class='verdict' id='savings-verdict'></p>"
            "<p>The last two rows are the other ways to fit a step: the <b>chunked loss</b> computes the output "
            "layer and the loss a chunk of tokens at a time, each chunk's gradients taken in the forward while "
            "its logits live, so the logits are never all alive and nothing is replayed; <b>offload</b> keeps "
            "every layer's saved tensors in host memory, "
            "copied back one layer ahead in the backward: it replays nothing, and its price is the copy time the "
            "compute does not hide (the time column; the host link from the GPU's datasheet). "
            "<code>recompute plan</code> chooses among all of them.</p>",
        ),
        section(
            "worked",
            "Worked example",
            "Per-layer forward FLOPs of attention and MLP; a step is forward + backward = 3F, and recomputation "
            "replays the forward of what it drops (<code>recompute.core.analytic.overhead_from_flops</code>).",
            _worked_table(report.worked),
        ),
        section(
            "attention",
            "Eager attention vs FlashAttention: the attention term",
            "Eager attention keeps the (b, a, s, s) softmax for the backward; FlashAttention / SDPA keeps a per-row "
            "log-sum-exp and recomputes the scores tile by tile: recomputation built into the kernel.",
            "<div id='attention' class='chart small'></div>",
        ),
    ]


def _worked_table(w: WorkedExample) -> str:
    base = w.attention + w.mlp
    rows = [f"<tr><td>baseline</td><td>3 × {base:g} = {w.step:g}</td><td>–</td></tr>"]
    for policy, overhead in w.rows.items():
        extra = overhead * w.step
        rows.append(
            f"<tr data-policy='{escape(policy)}'><td>{escape(policy)}</td><td>{w.step:g} + {extra:g} = "
            f"{w.step + extra:g}</td><td>+{100 * overhead:.1f} %</td></tr>"
        )
    return (
        f"<p>attention = {w.attention:g}, MLP = {w.mlp:g}</p><table id='worked-table'><thead><tr><th>strategy</th>"
        f"<th>step FLOPs</th><th>overhead</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _footer(report: Report) -> str:
    gpu = report.gpu
    skipped = "".join(f"<li>{escape(name)} left out: {escape(why)}</li>" for name, why in report.skipped.items())
    source = (
        "<code>recompute.core.analytic</code> (formulas and their limits: docs/analytic.md)"
        if report.models
        else "the model's profile (<code>recompute.trace.profile</code>, docs/profile.md) and the one planner"
    )
    return (
        f"<footer><p>Generated by recompute {escape(__version__)} from {source}. "
        f"GPU: {escape(gpu.label)}, {gib(gpu.memory)} reported, {gib(gpu.usable)} usable "
        f"(<code>recompute.core.hardware.usable_bytes</code>); source: {escape(gpu.source)}.</p>"
        f"{f'<ul>{skipped}</ul>' if skipped else ''}</footer>"
    )

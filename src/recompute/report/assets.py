"""The page's style sheet and script, as strings (kept here so that ``html.py`` reads as the page's outline).

The script reads the JSON block ``#data`` (``Report.to_dict``) and draws every chart with plotly's SVG
renderer (``bar`` and ``scatter`` traces, never ``scattergl``). The buttons set one of ``state``'s keys
(``data-set="model"`` with ``data-value="llama3.1-70b"``) and everything is drawn again from the data:
no number is computed in the page except unit conversions and the ratios in the verdicts.

``PAGE_JS`` defines ``window.RECOMPUTE`` (state, data, helpers, and the list of drawers); the optional
sections' scripts (``sections.py``) push their drawers onto it; ``START_JS`` binds the buttons and draws.
"""

from __future__ import annotations

__all__ = ["PAGE_CSS", "PAGE_JS", "START_JS"]

PAGE_CSS = """
:root { --ink: #1d2330; --muted: #5b6475; --line: #d9dde5; --bg: #f7f8fa; --accent: #2f6fde; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
       background: var(--bg); }
header, main, footer { max-width: 1180px; margin: 0 auto; padding: 0 24px; }
header { padding-top: 28px; }
h1 { margin: 0 0 4px; font-size: 28px; }
h2 { margin: 0 0 6px; font-size: 20px; }
.sub, .caption, footer { color: var(--muted); }
.caption { font-size: 13.5px; margin: 4px 0 10px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 18px 20px;
          margin: 18px 0; }
.controls { position: sticky; top: 0; z-index: 10; background: var(--bg); padding: 10px 0;
            border-bottom: 1px solid var(--line); display: flex; flex-wrap: wrap; gap: 8px 22px; }
.group { display: flex; align-items: center; gap: 4px; flex-wrap: wrap; }
.group > span { color: var(--muted); font-size: 13px; margin-right: 4px; }
button { font: inherit; font-size: 13.5px; padding: 4px 10px; border: 1px solid var(--line);
         border-radius: 6px; background: #fff; color: var(--ink); cursor: pointer; }
button.on { background: var(--accent); border-color: var(--accent); color: #fff; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(165px, 1fr)); gap: 12px; margin: 16px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 12px 14px; }
.card b { display: block; font-size: 24px; }
.card span { color: var(--muted); font-size: 13px; }
.chart { width: 100%; height: 460px; }
.chart.small { height: 380px; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
@media (max-width: 900px) { .pair { grid-template-columns: 1fr; } }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.on td { background: #eef3fd; }
.verdict { margin-top: 10px; padding: 8px 12px; border-left: 4px solid var(--accent); background: #f3f6fc; }
code { font-size: 13px; background: #f0f2f5; padding: 1px 4px; border-radius: 4px; }
.answer { border: 2px solid var(--accent); }
.answer.none { border-color: #c0392b; }
.answer .verdict b { font-size: 19px; }
.meter { height: 10px; background: #eef0f4; border-radius: 5px; overflow: hidden; margin: 8px 0; }
.meter div { height: 100%; background: var(--accent); }
.source { color: var(--muted); font-size: 13px; }
footer { font-size: 13px; padding-bottom: 32px; }
"""

PAGE_JS = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("data").textContent);
  const GiB = 2 ** 30;
  const CONFIG = { displaylogo: false, responsive: true };
  const COLORS = {
    parameters: "#8da0cb", gradients: "#a6b8de", optimizer: "#c7d3ec", outside: "#b3b3b3",
    checkpoints: "#ffd92f", norms: "#fc8d62", mlp: "#66c2a5", attention: "#2f6fde",
    checkpoint: "#ffd92f", buffers: "#dde3f0", other: "#e5c494",
    eager: "#e7298a", flash: "#1b9e77",
  };
  const POLICY_COLORS = {
    none: "#444444", core_attn: "#1b9e77", attn: "#2f6fde", mlp: "#66a61e", "attn+mlp": "#7570b3", block: "#d95f02",
    offload: "#e6ab02",
  };
  const state = { model: DATA.model, attention: DATA.workload.attention, policy: "none", scale: "linear" };
  const gib = (b) => b / GiB;
  const twoDigits = { minimumFractionDigits: 2, maximumFractionDigits: 2 };
  const fmtGiB = (b) => (b / GiB).toLocaleString("en-US", twoDigits) + " GiB";
  const pct = (f) => (100 * f).toFixed(1) + " %";
  const seqLabel = (s) => (s >= 1024 ? s / 1024 + "K" : String(s));
  const series = () => DATA.models[state.model];
  const byId = (id) => document.getElementById(id);
  const hover = (format, name) => "%{y:" + format + "}<extra>" + name + "</extra>";

  function layout(title, ytitle, extra) {
    const base = {
      title: { text: title, font: { size: 15 } },
      xaxis: { title: { text: "sequence length (tokens)" }, type: "category" },
      yaxis: { title: { text: ytitle } },
      margin: { t: 48, r: 16, b: 72, l: 72 },
      legend: { orientation: "h", y: -0.26 },
      paper_bgcolor: "#fff",
      plot_bgcolor: "#fff",
    };
    return Object.assign(base, extra || {});
  }

  function hline(x, value, name, dash) {
    const line = { color: "#c0392b", dash: dash, width: 2 };
    const y = x.map(() => gib(value));
    return { type: "scatter", mode: "lines", name: name, x: x, y: y, line: line, hovertemplate: hover(".2f", name) };
  }

  function drawMemory() {
    const m = series(), mem = m.memory[state.attention][state.policy], x = m.seq_lens.map(seqLabel);
    const traces = Object.keys(DATA.components).map((k) => ({
      type: "bar", name: DATA.components[k], x: x, y: mem.components[k].map(gib), marker: { color: COLORS[k] },
      hovertemplate: hover(".2f", DATA.components[k]) + " GiB",
    }));
    const diamond = { symbol: "diamond", size: 9, color: "#111" };
    traces.push({ type: "scatter", mode: "markers", name: "predicted peak", x: x, y: mem.peak.map(gib),
                  marker: diamond, hovertemplate: hover(".2f", "peak") });
    const g = DATA.gpu;
    traces.push(hline(x, g.memory, g.name + " memory", "dash"), hline(x, g.usable, g.name + " usable", "dot"));
    const title = "Training memory: " + m.name + ", policy " + state.policy + ", " + state.attention + " attention";
    const extra = {
      barmode: "stack",
      yaxis: { title: { text: "GiB per GPU" }, type: state.scale },
      legend: { orientation: "v", x: 1.02, y: 1, traceorder: "reversed" },
      margin: { t: 48, r: 8, b: 56, l: 72 },
    };
    Plotly.react("memory", traces, layout(title, "", extra), CONFIG);
  }

  // The plan of a plan section (report.extras.plan_view): its layers (when layersId) and its frontier.
  function drawPlan(plan, layersId, frontierId) {
    if (layersId) {
      const idx = plan.layers.map((_, i) => i), stored = plan.stored.length ? plan.stored : idx.map(() => 0);
      const bars = Object.keys(DATA.policies).concat(["offload"]).filter((p) => plan.layers.includes(p)).map((p) => {
        const mine = idx.filter((i) => plan.layers[i] === p);
        return { type: "bar", name: p, x: mine, y: mine.map((i) => gib(stored[i])),
                 marker: { color: POLICY_COLORS[p] }, hovertemplate: "layer %{x}: " + hover(".3f", p) };
      });
      const left = { xaxis: { title: { text: "layer" } }, barmode: "overlay" };
      Plotly.react(layersId, bars, layout("Policy and stored bytes per layer: " + plan.model, "GiB", left), CONFIG);
    }
    const f = plan.frontier, u = Object.keys(plan.uniform), c = plan.chosen;
    const traces = [
      { type: "scatter", mode: "lines+markers", name: "frontier", x: f.map((p) => gib(p.peak)),
        y: f.map((p) => 100 * p.overhead), text: f.map((p) => p.plan), line: { color: "#7570b3", shape: "hv" },
        hovertemplate: "%{x:.2f} GiB, +%{y:.1f} %<br>%{text}<extra>frontier</extra>" },
      { type: "scatter", mode: "markers+text", name: "uniform policies", x: u.map((n) => gib(plan.uniform[n].peak)),
        y: u.map((n) => 100 * plan.uniform[n].overhead), text: u, textposition: "top center",
        marker: { color: "#999", size: 8 } },
    ];
    if (c) {
      traces.push({ type: "scatter", mode: "markers", name: "the plan", x: [gib(c.peak)], y: [100 * c.overhead],
                    marker: { symbol: "star", size: 16, color: "#d95f02" } });
    }
    const budget = gib(plan.budget), dash = { color: "#c0392b", dash: "dash" };
    const line = { type: "line", yref: "paper", x0: budget, x1: budget, y0: 0, y1: 1, line: dash };
    const right = { xaxis: { title: { text: "predicted peak (GiB)" } }, shapes: plan.budget > 0 ? [line] : [] };
    const title = "Frontier: predicted peak against overhead (dashed: budget)";
    Plotly.react(frontierId, traces, layout(title, "recompute overhead (%)", right), CONFIG);
  }

  function drawOverhead() {
    const m = series(), x = m.seq_lens.map(seqLabel);
    const traces = Object.keys(DATA.policies).map((p) => ({
      type: "scatter", mode: "lines+markers", name: p, x: x, y: m.overhead[p].map((v) => 100 * v),
      customdata: m.layer_overhead[p].map((v) => 100 * v),
      line: { color: POLICY_COLORS[p], width: p === state.policy ? 4 : 1.6 },
      hovertemplate: "%{y:.1f} % of the step (per layer %{customdata:.1f} %)<extra>" + p + "</extra>",
    }));
    const title = "Compute overhead: " + m.name + " (recompute FLOPs / model FLOPs of the step)";
    Plotly.react("overhead", traces, layout(title, "overhead (%)"), CONFIG);
  }

  function drawAttention() {
    const m = series(), x = m.seq_lens.map(seqLabel);
    const names = { eager: "eager attention (stores the s² softmax)", flash: "FlashAttention / SDPA (log-sum-exp)" };
    const traces = ["eager", "flash"].map((a) => ({
      type: "scatter", mode: "lines+markers", name: names[a], x: x, y: m.memory[a].none.components.attention.map(gib),
      line: { color: COLORS[a], width: a === state.attention ? 4 : 2 }, hovertemplate: hover(".3g", a) + " GiB",
    }));
    traces.push({ type: "scatter", mode: "lines", name: "MLP term (either)", x: x,
                  y: m.memory.eager.none.components.mlp.map(gib), line: { color: "#999", dash: "dot" } });
    const title = "Attention activations of all layers (policy none): " + m.name;
    const extra = { yaxis: { type: "log", title: { text: "GiB (log)" } } };
    Plotly.react("attention", traces, layout(title, "", extra), CONFIG);
  }

  function cell(tr, text) {
    const td = document.createElement("td");
    td.textContent = text;
    tr.appendChild(td);
  }

  function verdict(rows) {
    const a = rows.find((r) => r.policy === "attn"), f = rows.find((r) => r.policy === "mlp");
    const attnWins = a.per_percent >= f.per_percent;
    const [win, lose] = attnWins ? ["attention", "the MLP"] : ["the MLP", "attention"];
    const ratio = attnWins ? a.per_percent / f.per_percent : f.per_percent / a.per_percent;
    return "With " + state.attention + " attention, recomputing " + win + " saves " + ratio.toFixed(1) +
      "× more memory per % of compute overhead than recomputing " + lose + " (attn " + fmtGiB(a.per_percent) +
      " vs mlp " + fmtGiB(f.per_percent) + " per 1 %).";
  }

  function fillSavings() {
    const m = series(), rows = m.savings[state.attention], body = byId("savings-body");
    byId("savings-caption").textContent = m.name + " at s = " + seqLabel(m.table_seq_len) + ", " + state.attention +
      " attention; out of " + fmtGiB(m.activations[state.attention]) + " of activations stored without recomputation.";
    body.replaceChildren();
    rows.forEach((r) => {
      const tr = document.createElement("tr");
      tr.dataset.policy = r.policy;
      tr.classList.toggle("on", r.policy === state.policy);
      cell(tr, r.policy + (DATA.strategies[r.policy] ? " (" + DATA.strategies[r.policy] + ")" : ""));
      cell(tr, fmtGiB(r.saved));
      cell(tr, "+" + pct(r.overhead));
      cell(tr, r.per_percent === null ? "–" : fmtGiB(r.per_percent));
      cell(tr, r.time_overhead === null ? "–" : "+" + pct(r.time_overhead));
      body.appendChild(tr);
    });
    byId("savings-verdict").textContent = verdict(rows);
  }

  function fillCards() {
    const m = series(), rows = m.savings[state.attention], stored = m.activations[state.attention];
    const block = rows.find((r) => r.policy === "block"), attnRow = rows.find((r) => r.policy === "attn");
    const last = m.seq_lens.length - 1, mem = m.memory[state.attention].none.components;
    const states = mem.parameters[0] + mem.gradients[0] + mem.optimizer[0];
    byId("card-params").textContent = (m.params / 1e9).toFixed(2) + " B";
    byId("card-states").textContent = fmtGiB(states);
    byId("card-stored").textContent = fmtGiB(stored);
    byId("card-stored-label").textContent = "activations at s = " + seqLabel(m.table_seq_len) + ", nothing recomputed";
    byId("card-attn").textContent = pct(attnRow.saved / stored) + " for +" + pct(attnRow.overhead);
    byId("card-block").textContent = pct(block.saved / stored) + " for +" + pct(block.overhead);
    byId("card-long").textContent = fmtGiB(mem.attention[last]);
    byId("card-long-label").textContent =
      "attention activations at s = " + seqLabel(m.seq_lens[last]) + " (" + state.attention + ")";
  }

  function markButtons() {
    document.querySelectorAll("button[data-set]").forEach((b) => {
      const on = state[b.dataset.set] === b.dataset.value;
      b.classList.toggle("on", on);
      b.setAttribute("aria-pressed", String(on));
    });
  }

  const R = {
    state: state, data: DATA, CONFIG: CONFIG, POLICY_COLORS: POLICY_COLORS, COLORS: COLORS,
    gib: gib, fmtGiB: fmtGiB, pct: pct, layout: layout, hover: hover, hline: hline, drawPlan: drawPlan,
    drawers: [markButtons, drawMemory, drawOverhead, drawAttention, fillSavings, fillCards],
    once: [],
  };
  // A model the analytic model does not read has no series: the page is its answer and its sections.
  R.render = () => (series() ? R.drawers : [markButtons]).forEach((draw) => draw());
  window.RECOMPUTE = R;
})();
"""

START_JS = """
(function (R) {
  "use strict";
  document.querySelectorAll("button[data-set]").forEach((b) =>
    b.addEventListener("click", () => { R.state[b.dataset.set] = b.dataset.value; R.render(); }));
  R.once.forEach((draw) => draw());
  R.render();
})(window.RECOMPUTE);
"""

"""End to end: the report in headless Chromium (Debian's ``chromium`` driven by ``playwright``), offline.

The page must load with no network and no console errors, draw every chart as non-empty SVG, follow its
model-size, policy and attention buttons, and show the analytic model's numbers. One browser session serves
the whole module. Without Chromium or playwright these tests FAIL and say what to install; they never skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tiny
from recompute import ModelSpec, Workload, estimate
from recompute.core.analytic.table import analytic_table, analytic_tables
from recompute.core.hardware import usable_bytes
from recompute.core.plan import plan
from recompute.report import bench_section, build_report, plan_section, render_html, trace_section
from recompute.report.answer import answer_data
from recompute.report.data import components
from recompute.trace import trace

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL = "apt-get update && apt-get install -y chromium && pip install playwright 'recompute[report]'"
GiB, K = 2**30, 1024
CHARTS = ("memory", "overhead", "attention", "trace", "bench-memory", "bench-time", "plan-layers", "plan-frontier")
LLAMA = ModelSpec.from_name("llama3.1-8b")


@dataclass
class Browser:
    page: Any
    html: Path
    folder: Path
    console: list[tuple[str, str]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


def _require_browser() -> None:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.fail(f"Chromium is not installed ({CHROMIUM}); the browser test cannot run. Install: {INSTALL}")
    for module in ("playwright", "plotly"):
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"the browser test needs the Python package {module!r}. Install: {INSTALL}")


def write_bench(path: Path) -> Path:
    """A bench file in `recompute bench`'s layout; its "measured" figures are synthetic (a test input)."""
    wl = Workload(attention="eager", seq_len=2 * K)
    ests = {p: estimate(LLAMA, wl, p) for p in ("none", "core_attn", "attn", "block")}
    times = {p: 1.0 + e.overhead / 2 for p, e in ests.items()}
    return tiny.write_bench(path, LLAMA, wl, times, peaks={p: 1.05 * e.peak for p, e in ests.items()})


def _write_report(folder: Path) -> Path:
    """The page for Llama 3.1 8B with all three optional sections (the trace: policy attn at s = 1K)."""
    plan_wl = Workload(seq_len=8 * K, attention="flash", precision="distributed", dp=8)
    plan_file = folder / "plan.json"
    plan_file.write_text(json.dumps(plan(analytic_table(LLAMA, plan_wl), 80 * GiB).to_dict()))
    sections = {
        "trace": trace_section(
            LLAMA, Workload(attention="eager", seq_len=1 * K), trace=trace, policies=("attn",), layers=1
        ),
        "bench": bench_section(write_bench(folder / "bench.json"), LLAMA),
        "plan": plan_section(plan_file, LLAMA),
    }
    html = folder / "report.html"
    report = build_report(LLAMA, Workload(attention="eager", seq_len=16 * K), sections=sections, answer=ANSWER)
    html.write_text(render_html(report))
    return html


ANSWER_WL = Workload(seq_len=16 * K, precision="distributed", dp=8)
ANSWER_PLAN = plan(analytic_tables(LLAMA, ANSWER_WL, losses=("chunked",)), 64 * GiB)
ANSWER = answer_data(ANSWER_PLAN, budget=64 * GiB, gpu="NVIDIA H100 SXM5 80GB", usable=usable_bytes("h100-80gb"),
                     command="recompute plan --model llama3.1-8b --seq-len 16384 ... -o plan.json")  # fmt: skip
"""The first screen's answer: the one planner's plan of Llama 3.1 8B at 16K for a 64 GiB budget (FLOPs)."""


def _block_network(browser: Browser, route: Any) -> None:
    if route.request.url.startswith("file:"):
        route.continue_()
    else:
        browser.requests.append(route.request.url)
        route.abort()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    _require_browser()
    from playwright.sync_api import sync_playwright

    folder = tmp_path_factory.mktemp("browser")
    html = _write_report(folder)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(folder / "user-data"),  # a fresh profile
            executable_path=shutil.which("chromium") or CHROMIUM,
            args=FLAGS,
            headless=True,
            offline=True,
            viewport={"width": 1280, "height": 900},
        )
        page = context.new_page()
        b = Browser(page=page, html=html, folder=folder)
        page.on("console", lambda m: b.console.append((m.type, m.text)))
        page.on("pageerror", lambda e: b.console.append(("pageerror", str(e))))
        page.route("**/*", lambda route: _block_network(b, route))
        page.goto(html.as_uri(), wait_until="load")
        page.wait_for_function("() => window.RECOMPUTE && document.querySelector('#memory .main-svg')")
        yield b
        context.close()


def select(page: Any, **choices: str) -> None:
    """Click the buttons for ``model=..., policy=..., attention=...``."""
    for key, value in choices.items():
        page.click(f"button[data-set='{key}'][data-value='{value}']")
        assert page.get_attribute(f"button[data-set='{key}'][data-value='{value}']", "aria-pressed") == "true"


def traces(page: Any, chart: str) -> dict[str, list[float]]:
    """What a chart draws: trace name -> y values, read from plotly's graph div."""
    return page.evaluate(
        "(id) => Object.fromEntries(document.getElementById(id).data.map(t => [t.name, Array.from(t.y)]))", chart
    )


def test_loads_offline_without_errors(browser: Browser) -> None:
    assert browser.page.evaluate("() => typeof Plotly") == "object"
    assert browser.requests == []
    errors = [m for m in browser.console if m[0] in ("error", "pageerror", "warning")]
    assert errors == []


def assert_drawn(page: Any, chart: str) -> None:
    """The chart is an SVG plot, wide enough, with at least one visible mark, and no canvas."""
    drawn = page.evaluate(
        """(id) => {
          const el = document.getElementById(id), svg = el.querySelector("svg.main-svg");
          const paths = el.querySelectorAll(".overplot .trace path, .cartesianlayer .trace path");
          const marks = Array.from(paths).filter(p => {
            const d = p.getAttribute("d"), box = p.getBBox();
            return d && box.width > 0 && box.height > 0;
          });
          return { svg: !!svg, width: svg ? svg.getBoundingClientRect().width : 0, marks: marks.length,
                   canvases: el.querySelectorAll("canvas").length };
        }""",
        chart,
    )
    assert drawn["svg"] and drawn["width"] > 300 and drawn["marks"] > 0 and drawn["canvases"] == 0, (chart, drawn)


@pytest.mark.parametrize("chart", CHARTS)
def test_every_chart_draws_svg(browser: Browser, chart: str) -> None:
    select(browser.page, policy="attn")  # the traced one
    assert_drawn(browser.page, chart)


@pytest.mark.parametrize(
    ("model", "policy", "attention"),
    [("llama3.1-70b", "block", "eager"), ("llama3.1-405b", "attn", "flash"), ("llama3.1-8b", "none", "eager")],
)
def test_buttons_change_the_memory_chart(browser: Browser, model: str, policy: str, attention: str) -> None:
    select(browser.page, model=model, policy=policy, attention=attention)
    shown = traces(browser.page, "memory")
    spec = ModelSpec.from_name(model)
    for i, s in enumerate((1 * K, 16 * K, 128 * K)):
        est = estimate(spec, Workload(seq_len=s, attention=attention), policy)
        j = (0, 4, 7)[i]
        for key, value in components(est).items():
            label = {"outside": "Embedding, head, logits", "mlp": "MLP"}.get(key, key.capitalize())
            assert shown[label][j] == pytest.approx(value / GiB, rel=1e-12), (label, s)
        assert shown["predicted peak"][j] == pytest.approx(est.peak / GiB, rel=1e-12)
    title = browser.page.text_content("#memory .gtitle")
    assert f"{model}, policy {policy}, {attention} attention" in title


def test_savings_table_shows_the_analytic_numbers(browser: Browser) -> None:
    select(browser.page, model="llama3.1-8b", attention="eager", policy="mlp")
    rows = browser.page.eval_on_selector_all(
        "#savings-body tr",
        "rows => rows.map(r => [r.dataset.policy, r.className, ...Array.from(r.cells, c => c.textContent)])",
    )
    wl = Workload(attention="eager", seq_len=16 * K)
    base = estimate(ModelSpec.from_name("llama3.1-8b"), wl, "none").activation_bytes
    other = {"chunked loss": (dataclasses.replace(wl, loss="chunked"), "none"), "offload": (wl, "offload")}
    for policy, css, _, saved, overhead, per, time in rows:
        at, name = other.get(policy, (wl, policy))
        est = estimate(ModelSpec.from_name("llama3.1-8b"), at, name)
        delta = base - est.activation_bytes
        assert saved == f"{delta / GiB:,.2f} GiB" and overhead == f"+{100 * est.overhead:.1f} %"
        assert per == (f"{delta / (100 * est.overhead) / GiB:,.2f} GiB" if est.overhead else "–")
        assert time == "–"  # built without predicted times
        assert (css == "on") == (policy == "mlp")
    assert [r[0] for r in rows] == ["core_attn", "attn", "mlp", "attn+mlp", "block", "chunked loss", "offload"]
    per_pct = {
        p: (base - estimate(ModelSpec.from_name("llama3.1-8b"), wl, p).activation_bytes)
        / (100 * estimate(ModelSpec.from_name("llama3.1-8b"), wl, p).overhead)
        for p in ("attn", "mlp")
    }
    ratio = per_pct["attn"] / per_pct["mlp"]
    assert f"recomputing attention saves {ratio:.1f}× more memory" in browser.page.text_content("#savings-verdict")


def test_attention_chart_and_switch(browser: Browser) -> None:
    select(browser.page, model="llama3.1-70b", attention="flash")
    shown = traces(browser.page, "attention")
    spec = ModelSpec.from_name("llama3.1-70b")
    for mode, name in (
        ("eager", "eager attention (stores the s² softmax)"),
        ("flash", "FlashAttention / SDPA (log-sum-exp)"),
    ):
        est = estimate(spec, Workload(seq_len=32 * K, attention=mode), "none")
        assert shown[name][5] == pytest.approx(est.activations["attention"] / GiB, rel=1e-12)
    caption = browser.page.text_content("#savings-caption")
    assert caption.startswith("llama3.1-70b at s = 16K, flash attention")


def test_overhead_chart_follows_the_model(browser: Browser) -> None:
    select(browser.page, model="llama3.1-405b")
    shown = traces(browser.page, "overhead")
    est = estimate(ModelSpec.from_name("llama3.1-405b"), Workload(attention="eager", seq_len=64 * K), "core_attn")
    assert shown["core_attn"][6] == pytest.approx(100 * est.overhead, rel=1e-12)


def test_trace_chart_follows_the_policy(browser: Browser) -> None:
    select(browser.page, policy="attn")
    shown = traces(browser.page, "trace")
    section = browser.page.evaluate("() => window.RECOMPUTE.data.sections.trace.policies.attn")
    assert shown["traced"][3] == pytest.approx(section["traced"]["attention"] / GiB, rel=1e-12)
    assert shown["analytic"][10] == pytest.approx(
        estimate(LLAMA, Workload(attention="eager", seq_len=K, device="cpu", precision="bf16"), "attn").peak / GiB,
        rel=1e-12,
    )
    select(browser.page, policy="block")
    assert "was not traced" in browser.page.text_content("#trace .gtitle")


def test_bench_chart_shows_measured_and_predicted(browser: Browser) -> None:
    shown = traces(browser.page, "bench-memory")
    est = estimate(LLAMA, Workload(attention="eager", seq_len=2 * K), "attn")
    assert shown["predicted peak"][2] == pytest.approx(est.peak / GiB, rel=1e-12)
    assert shown["measured peak"][2] == pytest.approx(1.05 * est.peak / GiB, rel=1e-12)
    overhead = traces(browser.page, "bench-time")
    assert overhead["measured overhead"][3] == pytest.approx(
        100 * (estimate(LLAMA, Workload(attention="eager", seq_len=2 * K), "block").overhead / 2) / 1.0, rel=1e-9
    )


def test_the_first_screen_answers(browser: Browser) -> None:
    """Before any scrolling: what fits, the plan, its peak against the budget, its cost and the line to apply it;
    the figures are the plan's."""
    page = browser.page
    page.evaluate("() => window.scrollTo(0, 0)")
    box = page.locator("#answer").bounding_box()
    viewport = page.viewport_size
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= viewport["height"], (box, viewport)
    assert box["width"] > 0.8 * min(viewport["width"], 1180)
    text = page.inner_text("#answer")
    assert text.startswith("What fits NVIDIA H100 SXM5 80GB: budget 64.00 GiB per GPU")
    assert page.inner_text("#answer-plan") == "mlp x28, none x4; chunked loss"
    assert f"predicted peak {ANSWER_PLAN.peak / GiB:.2f} GiB of 64.00 GiB" in page.inner_text("#answer-peak")
    assert f"{100 * ANSWER_PLAN.overhead:.1f} % of the step's FLOPs" in page.inner_text("#answer-cost")
    assert page.inner_text("#answer-apply") == "recompute.apply(model, 'plan.json', loss='chunked')"
    href = page.get_attribute("#answer a[download]", "href")
    assert href.startswith("data:application/json,")
    path = browser.folder / "first-screen.png"
    page.screenshot(path=str(path))  # the first screen only
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_screenshot(browser: Browser) -> None:
    select(browser.page, model="llama3.1-8b", policy="attn", attention="eager")
    path = browser.folder / "report.png"
    browser.page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 50_000
    print(f"screenshot: {path}")


@dataclass
class Profiled:
    """The report of a transformers config.json (a tiny Qwen2, profiled) with a plan file of its own."""

    page: Any
    config: str
    plan: dict[str, Any]
    console: list[tuple[str, str]]


PROFILED_WL = Workload(seq_len=32, micro_batch=2, dtype="fp32", attention="flash", device="cpu", precision="fp32")
SMALL = ["--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu"]


@pytest.fixture(scope="module")
def profiled(browser: Browser) -> Iterator[Profiled]:
    from recompute.cli import main
    from test_zoo import config_json

    folder = browser.folder / "profiled"
    folder.mkdir()
    config = str(config_json("qwen2", folder))
    plan_file, html = folder / "plan.json", folder / "report.html"
    budget = ["--budget", "1.45MiB"]  # between the smallest peak and none's (1.3 and 1.5 MiB)
    assert main(["plan", "--model", config, *SMALL, "--cost", "flops", *budget, "-o", str(plan_file)]) == 0
    argv = ["report", "--model", config, *SMALL, "--no-time", *budget, "--plan", str(plan_file), "-o", str(html)]
    assert main(argv) == 0
    page = browser.page.context.new_page()
    console: list[tuple[str, str]] = []
    page.on("console", lambda m: console.append((m.type, m.text)))
    page.on("pageerror", lambda e: console.append(("pageerror", str(e))))
    page.goto(html.as_uri(), wait_until="load")
    page.wait_for_function("() => window.RECOMPUTE && document.querySelector('#profile-memory .main-svg')")
    yield Profiled(page, config, json.loads(plan_file.read_text()), console)
    page.close()


PROFILED_CHARTS = ("profile-memory", "profile-layers", "profile-frontier", "plan-layers", "plan-frontier")


@pytest.mark.parametrize("chart", PROFILED_CHARTS)
def test_a_config_json_page_draws_its_charts(profiled: Profiled, chart: str) -> None:
    """A model the analytic model does not read is drawn from its profile: memory by component against the
    budget, the plan per layer and its frontier; and ``--plan``'s file for it (issue 36)."""
    assert_drawn(profiled.page, chart)
    assert [m for m in profiled.console if m[0] in ("error", "pageerror", "warning")] == []


def test_a_config_json_page_shows_its_profile(profiled: Profiled) -> None:
    """The memory chart's bars are the profile's components; the frontiers are the planner's points."""
    import recompute
    from recompute.core.policy import OFFLOAD_POLICIES
    from recompute.report.measured import MEASURED_COMPONENTS, profile_components

    prof = recompute.profile(profiled.config, PROFILED_WL, progress=False)
    shown = traces(profiled.page, "profile-memory")
    names = profiled.page.evaluate("() => Array.from(document.getElementById('profile-memory').data[0].x)")
    uniform = [p for p in prof.applicable() if p not in OFFLOAD_POLICIES]  # offload: unpriced in FLOPs
    assert names[:-1] == uniform and names[-1].startswith("the plan")
    for i, policy in enumerate(uniform):
        parts = profile_components(prof, [policy] * prof.n_layers)
        for key, label in MEASURED_COMPONENTS.items():
            assert shown[label][i] == pytest.approx(parts[key] / GiB, rel=1e-12), (policy, key)
        assert sum(parts.values()) == pytest.approx(
            prof.parameters + prof.optimizer + prof.other + prof.activations([policy] * prof.n_layers), rel=1e-12
        )
    plan = profiled.plan
    assert shown["predicted peak"][-1] == pytest.approx(plan["predicted"]["peak"] / GiB, rel=1e-12)
    for chart in ("profile-frontier", "plan-frontier"):
        frontier = profiled.page.evaluate(f"() => Array.from(document.getElementById('{chart}').data[0].x)")
        assert frontier == pytest.approx([p["peak"] / GiB for p in plan["frontier"]], rel=1e-12)
    layers = traces(profiled.page, "plan-layers")
    assert sorted(layers) == sorted(set(plan["policy"]["layers"]))

"""`recompute report`: the file it writes (self-contained, data equal to the analytic model), PNGs, speed, and
one-line errors for bad input. Needs the ``report`` extra (plotly, matplotlib); fails, not skips, without it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tiny
from recompute import ModelSpec, Workload, estimate
from recompute.cli import main
from recompute.core.analytic import layer_activations
from recompute.core.analytic.table import analytic_table
from recompute.core.plan import plan
from recompute.core.policy import Policy

GiB, K = 2**30, 1024
NEEDS = "pip install 'recompute[report]' (plotly, matplotlib)"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exits
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def page_data(html: str) -> dict:  # type: ignore[type-arg]
    """The JSON block the page embeds."""
    match = re.search(r"<script type='application/json' id='data'>(.*?)</script>", html, re.S)
    assert match, "no data block in the page"
    return json.loads(match.group(1))


def write_plan(path: Path, model: str = "llama3.1-8b", seq_len: int = 8 * K, budget: float = 80 * GiB) -> Path:
    """A real plan file from recompute.core.plan (flash attention, ZeRO-1 over 8 ranks, an 80 GB budget)."""
    wl = Workload(seq_len=seq_len, attention="flash", precision="distributed", dp=8)
    path.write_text(json.dumps(plan(analytic_table(ModelSpec.from_name(model), wl), budget).to_dict()))
    return path


@pytest.fixture(scope="module")
def default_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    """The default report for Llama 3.1 8B (no --trace), and the seconds it took."""
    missing = [m for m in ("plotly", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"the report tests need {', '.join(missing)}: {NEEDS}")
    out = tmp_path_factory.mktemp("report") / "report.html"
    start = time.perf_counter()
    assert main(["report", "--model", "llama3.1-8b", "-o", str(out)]) == 0
    return out.read_text(encoding="utf-8"), time.perf_counter() - start


def test_a_second_report_is_drawn_without_torch(default_page: tuple[str, float], tmp_path: Path) -> None:
    # the first report traced the step's kernels for its predicted times; the next one reads them from the cache
    out = tmp_path / "again.html"
    code = (
        "import sys; from recompute.cli import main; "
        f"assert main(['report', '--model', 'llama3.1-8b', '-o', {str(out)!r}]) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == default_page[0]
    assert "time overhead (predicted)" in default_page[0]


def test_page_is_self_contained(default_page: tuple[str, float]) -> None:
    html = default_page[0]
    assert html.count("<script") == 3  # plotly.js, the data, the page script: all inline
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|<img[^>]+src=|@import", html)
    assert "Plotly" in html and "scattergl" not in html.split("id='data'")[1]


@pytest.mark.parametrize(
    ("model", "attention", "policy", "seq_len"),
    [
        ("llama3.1-8b", "eager", "none", 16 * K),
        ("llama3.1-8b", "flash", "attn", 128 * K),
        ("llama3.1-70b", "eager", "block", 1 * K),
        ("llama3.1-405b", "flash", "core_attn", 32 * K),
    ],
)
def test_embedded_numbers_equal_the_analytic_model(
    default_page: tuple[str, float], model: str, attention: str, policy: str, seq_len: int
) -> None:
    series = page_data(default_page[0])["models"][model]
    i = series["seq_lens"].index(seq_len)
    est = estimate(ModelSpec.from_name(model), Workload(seq_len=seq_len, attention=attention), policy)
    mem = series["memory"][attention][policy]
    assert mem["total"][i] == est.total and mem["peak"][i] == est.peak
    assert mem["components"]["attention"][i] == est.activations["attention"]
    assert mem["components"]["parameters"][i] == est.states.parameters
    assert (
        series["overhead"][policy][i]
        == estimate(ModelSpec.from_name(model), Workload(attention="eager", seq_len=seq_len), policy).overhead
    )


def test_embedded_savings_table_equals_the_analytic_model(default_page: tuple[str, float]) -> None:
    rows = {r["policy"]: r for r in page_data(default_page[0])["models"]["llama3.1-8b"]["savings"]["eager"]}
    wl = Workload(attention="eager", seq_len=16 * K)
    base = estimate(ModelSpec.from_name("llama3.1-8b"), wl, "none").activation_bytes
    other = {"chunked loss": (dataclasses.replace(wl, loss="chunked"), "none"), "offload": (wl, "offload")}
    for name, row in rows.items():
        at, policy = other.get(name, (wl, name))
        est = estimate(ModelSpec.from_name("llama3.1-8b"), at, policy)
        assert row["saved"] == base - est.activation_bytes and row["overhead"] == est.overhead
        assert row["per_percent"] == (row["saved"] / (100 * est.overhead) if est.overhead else None)
        assert row["time_overhead"] is not None  # predicted on the default GPU; offload by its copy time


def test_worked_example_in_the_page(default_page: tuple[str, float]) -> None:
    html = default_page[0]
    for text in ("1200 + 100 = 1300", "+8.3 %", "1200 + 300 = 1500", "+25.0 %", "1200 + 400 = 1600", "+33.3 %"):
        assert text in html


def test_plan_section_and_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = write_plan(tmp_path / "plan.json")
    out, pngs = tmp_path / "r.html", tmp_path / "png"
    code, stdout, err = run(
        capsys, "report", "--model", "llama3.1-8b", "--plan", str(plan_file), "-o", str(out), "--png", str(pngs)
    )
    assert code == 0 and stdout.startswith(f"wrote {out}")
    assert all(line.startswith("time model: ") for line in err.splitlines())  # progress only
    section = page_data(out.read_text())["sections"]["plan"]
    policy = Policy.load(plan_file)
    wl = Workload(seq_len=8 * K, attention="flash", precision="distributed", dp=8)
    la = layer_activations(ModelSpec.from_name("llama3.1-8b"), wl)
    assert section["layers"] == list(policy.per_layer(32))
    assert section["stored"] == [la.stored(p) for p in section["layers"]]
    assert section["peak"] == estimate(ModelSpec.from_name("llama3.1-8b"), wl, policy).peak <= 80 * GiB
    assert len(section["frontier"]) == len(json.loads(plan_file.read_text())["frontier"])
    names = sorted(p.name for p in pngs.iterdir())
    assert names == [f"{k}-llama3.1-8b.png" for k in ("attention", "memory", "overhead", "plan")]
    for png in pngs.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def write_bench(path: Path, model: str = "gpt2", *, empty: bool = False) -> Path:
    """A `recompute bench --json` file with synthetic "measured" figures (a test input)."""
    spec, wl = ModelSpec.from_name(model), Workload(attention="eager", seq_len=512)
    times = {} if empty else {p: 0.2 * (1 + estimate(spec, wl, p).overhead) for p in ("none", "attn", "block")}
    return tiny.write_bench(path, spec, wl, times, peaks=dict.fromkeys(times, 1e9))


def test_bench_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    code, _, err = run(
        capsys, "report", "--model", "gpt2", "--bench", str(write_bench(tmp_path / "b.json")), "-o", str(out)
    )
    assert code == 0, err
    rows = page_data(out.read_text())["sections"]["bench"]["rows"]
    assert [r["policy"] for r in rows] == ["none", "attn", "block"]
    for row in rows:
        est = estimate(ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=512), row["policy"])
        assert row["predicted_peak"] == est.peak and row["predicted_overhead"] == est.overhead
        assert row["measured_peak"] == 1e9
        assert row["measured_overhead"] == pytest.approx(est.overhead, rel=1e-12)


def test_bench_section_says_the_steps_ran_compiled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_bench(tmp_path / "b.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"compiled": "block", "memory_budget": 0.5}))
    out = tmp_path / "r.html"
    rows = data["rows"]
    data["rows"] = rows + [{**r, "loss": "chunked"} for r in rows]  # bench --loss-modes full,chunked
    path.write_text(json.dumps(data | {"compiled": "block", "memory_budget": 0.5}))
    code, _, err = run(capsys, "report", "--model", "gpt2", "--bench", str(path), "-o", str(out))
    assert code == 0, err
    page = out.read_text()
    bench = page_data(page)["sections"]["bench"]
    assert (bench["compiled"], bench["memory_budget"]) == ("block", 0.5)
    assert [r["policy"] for r in bench["rows"]][::3] == ["none, full loss", "none, chunked loss"]
    assert (
        "the compiled step&#x27;s trace (steps run torch.compile&#x27;d: each block, activation_memory_budget 0.5)"
        in page
    )
    code, _, err = run(
        capsys, "report", "--model", "gpt2", "--bench", str(write_bench(tmp_path / "e.json")), "-o", str(out)
    )
    assert code == 0, err
    assert (
        page_data(out.read_text())["sections"]["bench"]["compiled"] is None and "compiled step" not in out.read_text()
    )


def test_bench_section_reads_real_bench_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench_json = tmp_path / "bench.json"
    shape = "--layers 2 --hidden 32 --heads 2 --vocab 64 --seq-len 32 --micro-batch 2 --device cpu".split()
    code, text, err = run(
        capsys, "bench", *shape, "--steps", "1", "--warmup", "0", "--policies", "none,block", "--json"
    )
    assert code == 0, err
    bench_json.write_text(text)
    written = json.loads(text)["rows"]
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", "--model", "gpt2", "--bench", str(bench_json), "-o", str(out))
    assert code == 0, err
    rows = page_data(out.read_text())["sections"]["bench"]["rows"]
    assert [r["policy"] for r in rows] == ["none", "block"]
    for row, raw in zip(rows, written, strict=True):
        assert row["step_time_s"] == raw["step_s"] and row["predicted_peak"] == raw["predicted_peak"]
        assert row["measured_peak"] == raw["peak"]


def test_trace_section(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trace` puts recompute.trace's bytes next to the analytic ones (two policies, 1 layer scaled: quick)."""
    import functools

    from recompute.cli import report
    from recompute.trace import trace

    monkeypatch.setattr(
        report, "trace_section", functools.partial(report.trace_section, policies=("none", "block"), layers=1)
    )
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", "--model", "gpt2", "--seq-len", "128", "--trace", "-o", str(out))
    assert code == 0, err
    section = page_data(out.read_text())["sections"]["trace"]
    wl = Workload(seq_len=128, device="cpu", precision="bf16")
    assert section["workload"] == wl.to_dict() and list(section["policies"]) == ["none", "block"]
    result = trace(ModelSpec.from_name("gpt2"), wl, "block", layers=1)
    traced, analytic = section["policies"]["block"]["traced"], section["policies"]["block"]["analytic"]
    assert traced["checkpoint"] == sum(p.components.get("checkpoint", 0) for p in result.layers)
    assert (traced["peak"], traced["optimizer"], traced["head"]) == (result.peak, result.optimizer, result.head.total)
    assert analytic["peak"] == estimate(ModelSpec.from_name("gpt2"), wl, "block").peak


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], str]]:
    tmp = tmp_path_factory.mktemp("bad")
    not_json = tmp / "bench.json"
    not_json.write_text("{oops")
    other = write_plan(tmp / "plan70.json", "llama3.1-70b", 4 * K, budget=2**50)
    not_plan = tmp / "policy.json"
    not_plan.write_text(json.dumps(Policy("block").to_dict()))
    return {
        "unknown model": (["--model", "llama9"], "'llama9' is not a known model"),
        "unknown gpu": (["--gpu", "b300"], "'b300' is not a known GPU; known GPUs: h100-80gb"),
        "missing plan": (["--plan", str(tmp / "nope.json")], f"plan file {str(tmp / 'nope.json')!r} does not exist"),
        "plan not json": (["--plan", str(not_json)], "is not valid JSON"),
        "not a plan": (["--plan", str(not_plan)], "is not a recompute plan file"),
        "plan for another model": (["--plan", str(other)], "is for model 'llama3.1-70b' ("),
        "missing bench": (["--bench", str(tmp / "nope.json")], f"bench results {str(tmp / 'nope.json')!r} does not"),
        "bench not json": (["--bench", str(not_json)], "is not valid JSON"),
        "bench for another model": (["--bench", str(write_bench(tmp / "b.json"))], "are for model 'gpt2', not 'llama3"),
        "bench without results": (
            ["--bench", str(write_bench(tmp / "e.json", "llama3.1-8b", empty=True))],
            "hold no rows",
        ),
        "sequence too long": (["--seq-len", str(256 * K)], "exceeds llama3.1-8b's 131072 positions"),
        "unwritable output": (["-o", str(tmp / "no" / "dir" / "r.html")], "does not exist; create it first"),
    }


BAD = ["unknown model", "unknown gpu", "missing plan", "plan not json", "not a plan", "plan for another model"]
BAD += ["missing bench", "bench not json", "bench for another model", "bench without results"]
BAD += ["sequence too long", "unwritable output"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(
    bad_inputs: dict[str, tuple[list[str], str]], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    argv, message = bad_inputs[case]  # later options override the defaults before them
    code, out, err = run(capsys, "report", "--model", "llama3.1-8b", "-o", str(tmp_path / "r.html"), *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("recompute report: error: ") and message in err


def test_missing_extra_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    out = tmp_path / "never-written.html"
    code, _, err = run(capsys, "report", "--model", "gpt2", "-o", str(out))
    assert code == 2 and "needs plotly; install the extra: pip install 'recompute[report]'" in err
    assert not out.exists()


def test_a_report_answers_for_any_model_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json (transformers' class, profiled) and a factory the analytic model cannot read: the page
    opens on the one planner's answer, the same plan `recompute plan` gives; the factory's page has no charts
    and refuses the sections drawn against the analytic model."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_zoo import config_json

    small = ["--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu", "--no-time"]
    for model in (str(config_json("qwen2", tmp_path)), "test_real_runs:small_factory"):
        code, out, err = run(capsys, "plan", "--model", model, *small[:-1], "--cost", "flops", "--budget", "1e15",
                             "--json")  # fmt: skip
        assert code == 0, err
        front = json.loads(out)["frontier"]
        budget = (front[0]["peak"] + front[-1]["peak"]) / 2
        page = tmp_path / "page.html"
        code, _, err = run(capsys, "report", "--model", model, *small, "--budget", str(budget), "-o", str(page))
        assert code == 0, err
        answer = page_data(page.read_text())["answer"]
        code, out, _ = run(capsys, "plan", "--model", model, *small[:-1], "--cost", "flops", "--budget", str(budget),
                           "--json")  # fmt: skip
        planned = json.loads(out)
        assert answer["layers"] == planned["policy"]["layers"] and answer["chosen"]["peak"] <= budget
        assert answer["chosen"]["peak"] == pytest.approx(planned["predicted"]["peak"], rel=1e-12)
        html = page.read_text()
        assert html.index("id='answer'") < html.index("id='s-profile'") < html.index("</main>")
        drawn = page_data(html)["sections"]["profile"]
        assert drawn["plan"]["chosen"]["peak"] == answer["chosen"]["peak"] and drawn["budget"] == budget
        assert [b["name"] for b in drawn["bars"]][-1] == "the plan" and drawn["bars"][-1]["fits"]
        assert "id='memory'" not in html and "is not drawn here" not in html  # the analytic sweep: presets only
    code, _, err = run(capsys, "report", "--model", "test_real_runs:small_factory", *small, "--trace", "-o", str(page))
    assert code == 2 and "draw(s) against the analytic model" in err and len(err.strip().splitlines()) == 1


def test_report_plan_takes_a_config_json_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``report --plan`` for a model planned from its profile draws the file as its planner predicted it, and
    refuses, in one line, a plan made for another config (issue 36: it refused them all)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_zoo import config_json

    small = ["--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu"]
    model, plan_file = str(config_json("qwen2", tmp_path)), tmp_path / "plan.json"
    code, _, err = run(capsys, "plan", "--model", model, *small, "--cost", "flops", "--budget", "1e15",
                       "-o", str(plan_file))  # fmt: skip
    assert code == 0, err
    written = json.loads(plan_file.read_text())
    page = tmp_path / "page.html"
    argv = ["report", "--model", model, *small, "--no-time", "--plan", str(plan_file), "-o", str(page)]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    drawn = page_data(page.read_text())["sections"]["plan"]
    assert drawn["layers"] == written["policy"]["layers"] and drawn["stored"] == written["predicted"]["kept"]
    assert drawn["chosen"]["peak"] == written["predicted"]["peak"]
    assert [p["peak"] for p in drawn["frontier"]] == [p["peak"] for p in written["frontier"]]
    other = tmp_path / "wider.json"  # another architecture: a wider MLP
    other.write_text(json.dumps(json.loads(Path(model).read_text()) | {"intermediate_size": 128}))
    code, out, err = run(capsys, "report", "--model", str(other), *small, "--no-time", "--plan", str(plan_file),
                         "-o", str(page))  # fmt: skip
    refusal = err.strip().splitlines()[-1]  # after the profile's progress lines
    assert code == 2 and out == "" and "Traceback" not in err and refusal.startswith("recompute report: error: "), err
    assert f"plan file {str(plan_file)!r} is for model 'qwen2' (" in refusal
    assert refusal.endswith("pass the --model it was made for, or make one for this model with recompute plan -o")

"""The planner: exact against brute force over both kinds of cost table (the analytic model's and a measured
profile's), a monotone frontier, plans that fit, clear failures."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from recompute import ModelSpec, Policy, Workload, estimate
from recompute.cli import main
from recompute.core.analytic.table import analytic_table
from recompute.core.costs import CostTable, KindCosts, LinkCost, TopCost
from recompute.core.errors import ConfigError
from recompute.core.hardware import usable_bytes
from recompute.core.identity import spec_id
from recompute.core.plan import best_uniform, frontier, parse_budget, plan
from recompute.core.policy import POLICIES
from recompute.core.pricing import measured_costs
from recompute.core.search import search, smallest_peak
from tiny import tiny_gpt, tiny_llama, write_bench

TINY = ModelSpec(hidden=256, n_layers=6, n_heads=4, max_positions=4096, vocab=8000, name="tiny")
EAGER = Workload(seq_len=2048, micro_batch=2, dtype="fp32", device="cpu")  # long enough for the s^2 term


@pytest.fixture(scope="module")
def brute_force() -> list[tuple[float, float]]:
    """(peak, recompute FLOPs) of every one of the 6^6 per-layer assignments, from ``estimate``."""
    return [
        (est.peak, est.recompute_flops)
        for layers in itertools.product(POLICIES, repeat=TINY.n_layers)
        for est in [estimate(TINY, EAGER, Policy(layers=layers))]
    ]


def _budgets(points: list[tuple[float, float]], n: int = 9) -> list[float]:
    lo, hi = min(p for p, _ in points), max(p for p, _ in points)
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def test_plan_equals_brute_force_on_a_six_layer_chain(brute_force: list[tuple[float, float]]) -> None:
    for budget in _budgets(brute_force):
        best = min(cost for peak, cost in brute_force if peak <= budget)
        chosen = plan(analytic_table(TINY, EAGER), budget)
        assert chosen.cost == pytest.approx(best, rel=1e-12), budget
        assert chosen.peak <= budget and estimate(TINY, EAGER, chosen.policy).peak <= budget
        assert chosen.recompute_flops == pytest.approx(best, rel=1e-12)


def test_frontier_is_the_brute_force_pareto_set(brute_force: list[tuple[float, float]]) -> None:
    pareto = []
    for peak, cost in sorted(brute_force):
        if not pareto or cost < pareto[-1][1] - 1e-6:
            pareto.append((peak, cost))
    got = [(p.peak, p.cost) for p in frontier(analytic_table(TINY, EAGER))]
    assert len(got) == len(pareto)
    for (gp, gc), (bp, bc) in zip(got, pareto, strict=True):
        assert gp == pytest.approx(bp, rel=1e-12) and gc == pytest.approx(bc, rel=1e-12)


def test_pipeline_plans_repeat_the_first_stage() -> None:
    spec = ModelSpec(hidden=256, n_layers=6, n_heads=4, max_positions=4096, vocab=8000, name="tiny")
    wl = Workload(seq_len=2048, micro_batch=1, pp=2)
    results = [
        (est.peak, est.recompute_flops)
        for stage in itertools.product(POLICIES, repeat=3)
        for est in [estimate(spec, wl, Policy(layers=stage * 2))]
    ]
    pareto = []
    for peak, cost in sorted(results):
        if not pareto or cost < pareto[-1][1] - 1e-6:
            pareto.append((peak, cost))
    got = [x for p in frontier(analytic_table(spec, wl)) for x in (p.peak, p.cost)]
    assert got == pytest.approx([x for point in pareto for x in point], rel=1e-12)  # (k - 1) S: exact too
    for budget in _budgets(results, 5):
        best = min(cost for peak, cost in results if peak <= budget)
        assert plan(analytic_table(spec, wl), budget).cost == pytest.approx(best, rel=1e-12)


def random_table(seed: int, *, n: int = 5, in_flight: float = 1.0, bottom_heavy: bool = False) -> CostTable:
    """A cost table with everything the analytic one lacks: two kinds, links that depend on the next layer's
    option, forward phases, an option that loads the next layer's backward (as offload does), host bytes.

    ``bottom_heavy``: the lower a layer, the higher its backward's base, as when the gradients the backward makes
    dominate (a large model at a short sequence): the peak is settled low in the chain."""
    rng = random.Random(seed)
    options = ("none", "a", "b", "off")
    kinds = tuple(
        KindCosts(
            name=f"kind {k}",
            options=options,
            forward={o: rng.uniform(-5, 5) for o in options},
            kept={o: rng.uniform(0, 50) for o in options},
            flops={"none": 0.0, **{o: rng.uniform(1, 20) for o in options[1:]}},
            below={"off": rng.uniform(0, 30)},
            host={"off": rng.choice((10.0, 15.0))},
        )
        for k in range(2)
    )
    layer_kind = tuple(rng.randrange(2) for _ in range(n))
    links = {
        (a, b): {p: {q: LinkCost(rng.uniform(0, 40), rng.uniform(-10, 10)) for q in options} for p in options}
        for a in range(2)
        for b in range(2)
    }
    return CostTable(
        model="random",
        workload=Workload().to_dict(),
        kinds=kinds,
        layer_kind=layer_kind,
        links=links,
        last={
            o: TopCost(rng.uniform(0, 40), rng.uniform(-10, 10), rng.uniform(0, 20), rng.uniform(0, 20))
            for o in options
        },
        base_forward=tuple(rng.uniform(50, 100) for _ in range(n)),
        base_backward=tuple(
            tuple(rng.uniform(250, 270) - 40 * i for i in range(n))
            if bottom_heavy
            else (rng.uniform(50, 120) for _ in range(n))
        ),
        head_forward=rng.uniform(60, 100),
        head_backward=rng.uniform(60, 100),
        fixed={"optimizer step": rng.uniform(50, 150)},
        model_layers=n,
        model_flops=1000.0,
        tokens=1,
        in_flight=in_flight,
    )


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("in_flight", "bottom_heavy"), [(1.0, False), (2.5, False), (1.0, True)], ids=["k=1", "k=2.5", "bottom-heavy"]
)
def test_search_equals_brute_force_on_any_table(seed: int, in_flight: float, bottom_heavy: bool) -> None:
    """The one search over a table as a profile makes it (links, forward phases, copies into the next layer's
    backward) and with micro-batches in flight: its frontier is the brute force's, and so is every budget's
    cheapest plan, with and without a cap on host bytes. Bottom-heavy tables settle most states early."""
    table = random_table(seed, in_flight=in_flight, bottom_heavy=bottom_heavy)
    every = [table.compose(layers) for layers in itertools.product(table.options(), repeat=table.n)]
    pareto: list[tuple[float, float]] = []
    for c in sorted(every, key=lambda c: (c.peak, c.flops)):
        if not pareto or c.flops < pareto[-1][1] - 1e-9:
            pareto.append((c.peak, c.flops))
    got = [x for c in search(table).frontier for x in (c.peak, c.flops)]
    assert got == pytest.approx([x for point in pareto for x in point], rel=1e-12)
    assert smallest_peak(table) == pytest.approx(pareto[0][0], rel=1e-12)
    for budget in _budgets([(c.peak, c.flops) for c in every], 7):
        for cap in (None, 20.0):
            fits = [c.flops for c in every if c.peak <= budget and (cap is None or c.host <= cap)]
            found = search(table, budget, host_budget=cap).chosen
            assert (found is None) == (not fits)
            if found is not None:
                assert found.flops == pytest.approx(min(fits), rel=1e-12) and found.peak <= budget * (1 + 1e-12)


def test_bottom_heavy_tables_settle_states_early() -> None:
    """The brute-force test above reaches the search's settled states (Note: [settled states] in
    core/search.py): in most bottom-heavy tables some states are finished before the top layer."""
    from recompute.core.search import _States

    settled = [bool(_States(random_table(s, bottom_heavy=True), math.inf, None, costs=True).done) for s in range(12)]
    assert sum(settled) >= 6, settled


CASES = {
    "gpt2 b16": ("gpt2", Workload(seq_len=1024, micro_batch=16)),
    "llama8b flash distributed": (
        "llama3.1-8b",
        Workload(seq_len=8192, attention="flash", precision="distributed", dp=8),
    ),
    "llama70b t8 sp p4": ("llama3.1-70b", Workload(seq_len=8192, tp=8, sp=True, pp=4)),
    "175b t8 sp p8 m3": ("175b", Workload(seq_len=2048, tp=8, sp=True, pp=8, interleave=3)),
    "llama8b fsdp 8": ("llama3.1-8b", Workload(seq_len=8192, fsdp=True, dp=8)),
}


@pytest.mark.parametrize(("name", "wl"), list(CASES.values()), ids=list(CASES))
def test_frontier_is_monotone_and_every_plan_fits(name: str, wl: Workload) -> None:
    spec = ModelSpec.from_name(name)
    table = analytic_table(spec, wl)
    points = frontier(table)
    assert all(a.peak < b.peak and a.cost > b.cost for a, b in itertools.pairwise(points))
    assert points[0].peak == pytest.approx(smallest_peak(table), rel=1e-12)
    for fraction in (0.0, 0.3, 0.6, 1.0):
        budget = points[0].peak + fraction * (points[-1].peak - points[0].peak)
        chosen = plan(table, budget)
        # The cost table's composed peak is the estimate's own chain walk, for the whole model.
        assert chosen.peak == pytest.approx(estimate(spec, wl, chosen.policy).peak, rel=1e-12)
        assert chosen.peak <= budget


@pytest.mark.parametrize(("name", "wl"), list(CASES.values())[:2], ids=list(CASES)[:2])
def test_plan_beats_or_equals_the_best_every_kth_setting(name: str, wl: Workload) -> None:
    spec = ModelSpec.from_name(name)
    points = frontier(analytic_table(spec, wl))
    budget = (points[0].peak + points[-1].peak) / 2
    uniform = best_uniform(spec, wl, budget)
    assert uniform is not None
    assert plan(analytic_table(spec, wl), budget).cost <= uniform[1].recompute_flops * (1 + 1e-12)


TRACED = {
    "gpt-dropout": (tiny_gpt(6), "eager"),
    "gpt": (tiny_gpt(6, dropout=0.0), "eager"),
    "gpt-flash": (tiny_gpt(6, dropout=0.0), "flash"),  # at 70 % the analytic plan's traced peak is over (below)
    "llama": (tiny_llama(6), "eager"),
    "llama-flash": (tiny_llama(6), "flash"),
}


@pytest.mark.parametrize(("spec", "attention"), list(TRACED.values()), ids=list(TRACED))
def test_traced_plans_fit_by_the_trace(spec: ModelSpec, attention: str) -> None:
    """A plan that fits really fits: the real step's peak (fake-tensor trace) is within the budget too."""
    from recompute.trace import trace

    wl = Workload(seq_len=64, micro_batch=2, dtype="fp32", device="cpu", attention=attention)
    none = estimate(spec, wl, "none")
    for fraction in (0.3, 0.7):
        budget = none.states.total + fraction * (none.peak - none.states.total)
        chosen = plan(analytic_table(spec, wl), budget, traced_peak=lambda pol, w: trace(spec, w, pol).peak)
        assert chosen.traced_peak is not None and chosen.traced_peak <= budget
        # Without the trace the analytic plan is the same or a neighbour: the analytic peak is close.
        assert abs(plan(analytic_table(spec, wl), budget).peak / chosen.traced_peak - 1) < 0.05
    assert trace(spec, wl, chosen.policy).peak == chosen.traced_peak  # an independent trace


def test_the_trace_check_replaces_an_analytic_plan_that_is_over_the_budget() -> None:
    """The analytic peak can fall just under the trace: here its plan's real step is over the budget."""
    from recompute.trace import trace

    spec = tiny_llama(6)
    wl = Workload(seq_len=64, micro_batch=2, dtype="fp32", device="cpu", attention="flash")
    none, block = estimate(spec, wl, "none"), estimate(spec, wl, "block")
    budget = block.peak + 0.1 * (none.peak - block.peak)
    analytic = plan(analytic_table(spec, wl), budget)
    assert analytic.peak <= budget < trace(spec, wl, analytic.policy).peak
    checked = plan(analytic_table(spec, wl), budget, traced_peak=lambda pol, w: trace(spec, w, pol).peak)
    assert checked.policy != analytic.policy and checked.traced_peak is not None and checked.traced_peak <= budget


def test_on_cuda_the_trace_check_fits_what_the_caching_allocator_reserves() -> None:
    """A CUDA plan checked by its trace must fit what PyTorch's caching allocator reserves over its steps (replayed
    from the trace, ``recompute.core.allocator``), not only the allocated peak: here the analytic plan's traced peak
    fits the budget and its reserve does not, so a smaller plan is chosen."""
    from recompute.trace import step_needs, trace

    spec = tiny_llama(6, hidden=512, vocab=4096, max_positions=512)
    wl = Workload(seq_len=512, micro_batch=4, dtype="bf16", precision="bf16", device="cuda", attention="flash")
    none, block = estimate(spec, wl, "none"), estimate(spec, wl, "block")
    budget = block.peak + 0.8 * (none.peak - block.peak)
    analytic = trace(spec, wl, plan(analytic_table(spec, wl), budget).policy)
    assert analytic.reserved is not None and analytic.peak <= budget < analytic.reserved
    checked = plan(analytic_table(spec, wl), budget, traced_peak=step_needs(spec))
    assert checked.traced_peak is not None and checked.traced_reserved is not None
    assert checked.traced_peak < checked.traced_reserved <= budget
    assert trace(spec, wl, checked.policy).reserved == checked.traced_reserved  # an independent trace
    assert checked.to_dict()["predicted"]["traced_reserved"] == checked.traced_reserved


def test_a_budget_checked_by_the_reserve_leaves_out_the_fragmentation_allowance() -> None:
    replayed = parse_budget("h100-80gb", replayed=True)
    assert replayed == usable_bytes("h100-80gb", fragmentation=0.0) > parse_budget("h100-80gb")
    assert parse_budget("70GiB", replayed=True) == parse_budget("70GiB") == 70 * 2**30


def test_nothing_fits_names_the_smallest_peak_and_a_fix() -> None:
    """Llama-3.1-8B's mixed-precision states (18 B per parameter) alone are over 75 GiB: said, with the changes
    that fit, each priced by the analytic model at its workload."""
    spec, wl = ModelSpec.from_name("llama3.1-8b"), Workload(seq_len=8192)
    smallest = frontier(analytic_table(spec, wl))[0].peak / 2**30
    states = estimate(spec, wl).states.total / 2**30
    distributed = smallest_peak(analytic_table(spec, Workload(seq_len=8192, precision="distributed", dp=8))) / 2**30
    fsdp = smallest_peak(analytic_table(spec, Workload(seq_len=8192, fsdp=True, dp=4))) / 2**30  # dp 2: 76.7 GiB
    with pytest.raises(ConfigError) as refused:
        plan(analytic_table(spec, wl), 75 * 2**30, alternatives=lambda w: smallest_peak(analytic_table(spec, w)))
    message = str(refused.value)
    assert f"smallest achievable peak of llama3.1-8b at b=1 s=8192 is {smallest:.1f} GiB" in message
    assert f"the model states ({states:.1f} GiB: 18 B per parameter under mixed) alone are over the budget" in message
    assert f"would fit: --precision distributed --dp 8 ({distributed:.1f} GiB); or --fsdp --dp 4 ({fsdp:.1f} GiB)" in (
        message
    )
    assert "--dp 8 (" not in message.split("--fsdp --dp 4")[1]  # FSDP over the fewest ranks that fit, once
    assert "\n" not in message


def test_nothing_fits_names_a_gpu_when_activations_are_the_reason() -> None:
    """The states fit; the activations at s = 65536 do not fit an A100's 40 GB even with every layer recomputed:
    a GPU that holds the smallest achievable peak is named."""
    spec, wl = ModelSpec.from_name("llama3.1-8b"), Workload(seq_len=65536, fsdp=True, dp=8)
    smallest = smallest_peak(analytic_table(spec, wl))
    with pytest.raises(ConfigError) as refused:
        plan(analytic_table(spec, wl), 30 * 2**30, alternatives=lambda w: smallest_peak(analytic_table(spec, w)))
    message = str(refused.value)
    assert "alone are over" not in message and smallest > 30 * 2**30
    assert "usable)" in message


@pytest.mark.parametrize(
    ("text", "value"), [("70GiB", 70 * 2**30), ("80 GB", 80e9), ("7.5e10", 7.5e10), ("512MiB", 2**29), (1e9, 1e9)]
)
def test_parse_budget(text: str | float, value: float) -> None:
    assert parse_budget(text) == value


def test_a_budget_may_name_a_gpu() -> None:
    assert parse_budget("rtx4090-24gb") == usable_bytes("rtx4090-24gb") == parse_budget(" RTX4090-24GB ")


@pytest.mark.parametrize("text", ["lots", "70 GiBs", "-5GB", "0"])
def test_bad_budgets(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_budget(text)


def test_cli_plan_writes_a_file_apply_and_estimate_read(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "plan.json"
    workload = ["--model", "llama3.1-70b", "--seq-len", "8192", "--tp", "8", "--sp", "--pp", "4"]
    assert main(["plan", *workload, "--budget", "70GiB", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "frontier" in text and "* " in text
    policy = Policy.load(out)
    assert policy.model == spec_id(ModelSpec.from_name("llama3.1-70b")) and len(policy.per_layer(80)) == 80
    assert main(["estimate", *workload, "--policy", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    predicted = json.loads(out.read_text())["predicted"]["peak"]
    assert data["chosen"]["peak"] == pytest.approx(predicted, rel=1e-12) and predicted <= 70 * 2**30


@pytest.mark.parametrize(
    "argv",
    [
        ["--budget", "1GiB"],
        ["--budget", "lots"],
        [],
        ["--budget", "70GiB", "--cost", "measured"],
        ["--budget", "70GiB", "--cost", "measured", "--bench", "missing.json"],
    ],
    ids=["nothing fits", "bad budget", "no budget", "measured without bench", "missing bench file"],
)
def test_cli_plan_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    try:
        code = main(["plan", "--model", "gpt2", *argv])
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_compiled_bench_results_price_no_eager_plan(tmp_path) -> None:
    times = {"none": 1.0, "core_attn": 1.02, "attn": 1.08, "mlp": 1.2, "attn+mlp": 1.3, "block": 1.31}
    spec, wl = ModelSpec.from_name("gpt2"), Workload(seq_len=1024, micro_batch=8)
    path = write_bench(tmp_path / "bench.json", spec, wl, times)
    path.write_text(json.dumps({**json.loads(path.read_text()), "compiled": "model"}))
    with pytest.raises(ConfigError, match=r"ran torch.compile'd \(model\), which prices no eager plan"):
        measured_costs(path, spec.name, spec.n_layers)


def test_measured_costs_from_bench_results(tmp_path) -> None:
    times = {"none": 1.0, "core_attn": 1.02, "attn": 1.08, "mlp": 1.2, "attn+mlp": 1.3, "block": 1.31}
    spec, wl = ModelSpec.from_name("gpt2"), Workload(seq_len=1024, micro_batch=8)
    bench = write_bench(tmp_path / "bench.json", spec, wl, times)
    seconds, base = measured_costs(bench, spec.name, spec.n_layers)
    points = frontier(analytic_table(spec, wl, seconds=seconds, model_seconds=base, cost_kind="measured seconds"))
    assert points[-1].cost == 0 and points[0].overhead == pytest.approx(0.31, rel=1e-9)

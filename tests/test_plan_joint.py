"""The joint planner (issue 15): per layer among keep, each recompute policy and offload, the loss mode as a
global choice; exact against brute force over every assignment and loss mode of a four-layer chain."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from recompute import ModelSpec, Policy, Workload, estimate
from recompute.cli import main
from recompute.core.analytic.memory import layer_activations
from recompute.core.analytic.table import analytic_tables
from recompute.core.hardware import datasheet_device
from recompute.core.plan import frontier, plan
from recompute.core.policy import POLICIES
from recompute.core.pricing import offload_seconds

TINY = ModelSpec(hidden=256, n_layers=4, n_heads=4, max_positions=4096, vocab=32000, name="tiny")
WL = Workload(seq_len=2048, micro_batch=2, dtype="fp32", device="cpu")
LOSSES = ("full", "chunked")
OFFLOAD = 3e9
"""An offloaded layer's cost in the FLOP unit of these plans: dearer than core_attn, cheaper than block."""


def _mode(loss: str) -> Workload:
    return dataclasses.replace(WL, loss=loss)


def _brute_force(options: tuple[str, ...]) -> list[tuple[float, float, bool]]:
    """(peak, cost, offloads) of every assignment of ``options`` to the layers, in both loss modes, from
    ``estimate`` (the chunked loss replays nothing: the same FLOPs as the full)."""
    out = []
    for loss in LOSSES:
        for layers in itertools.product(options, repeat=TINY.n_layers):
            est = estimate(TINY, _mode(loss), Policy(layers=layers))
            out.append((est.peak, est.recompute_flops + OFFLOAD * layers.count("offload"), "offload" in layers))
    return out


@pytest.fixture(scope="module")
def recompute_only() -> list[tuple[float, float, bool]]:
    return _brute_force(tuple(POLICIES))


@pytest.fixture(scope="module")
def with_offload() -> list[tuple[float, float, bool]]:
    return _brute_force((*POLICIES, "offload"))


def _budgets(points: list[tuple[float, float, bool]], n: int = 11) -> list[float]:
    lo, hi = min(p[0] for p in points), max(p[0] for p in points)
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def test_the_loss_mode_is_chosen_as_brute_force_would(recompute_only: list[tuple[float, float, bool]]) -> None:
    chosen_modes = set()
    for budget in _budgets(recompute_only):
        best = min(cost for peak, cost, _ in recompute_only if peak <= budget)
        got = plan(analytic_tables(TINY, WL, losses=LOSSES), budget)
        assert got.cost == pytest.approx(best, rel=1e-12), budget
        assert got.peak <= budget and got.workload["loss"] in LOSSES
        chosen_modes.add(got.workload["loss"])
    assert chosen_modes == set(LOSSES)  # tight budgets take the chunked loss; loose ones keep the full (a tie)


def test_offload_plans_are_exactly_the_brute_forces(with_offload: list[tuple[float, float, bool]]) -> None:
    """Offload is one more option per layer: the cheapest plan at each budget is the brute force's, offloading
    plans included (a layer's backward holds the offloaded layer below it, being copied back)."""
    tables = analytic_tables(TINY, WL, losses=LOSSES, offload=OFFLOAD)
    assert frontier(tables)[0].peak == pytest.approx(min(p[0] for p in with_offload), rel=1e-12)
    offloaded = 0
    for budget in _budgets(with_offload):
        best = min(cost for peak, cost, _ in with_offload if peak <= budget)
        got = plan(tables, budget)
        assert got.cost == pytest.approx(best, rel=1e-12) and got.peak <= budget
        assert estimate(TINY, _mode(got.loss), got.policy).peak == pytest.approx(got.peak, rel=1e-12)
        offloaded += "offload" in got.layers
    assert offloaded  # some budget is met more cheaply by offloading than by recomputing


@pytest.mark.parametrize("cap", [1, 2])
def test_a_host_budget_caps_the_offloaded_layers(cap: int) -> None:
    """Offloaded layers take pinned host memory: a plan offloads no more layers than the host budget holds, and
    is the cheapest of the brute force over the assignments within the cap."""
    per_layer = layer_activations(TINY, WL).offloaded("offload")
    host = cap * per_layer * 1.001
    within = []
    for loss in LOSSES:
        for layers in itertools.product((*POLICIES, "offload"), repeat=TINY.n_layers):
            if layers.count("offload") <= cap:
                est = estimate(TINY, _mode(loss), Policy(layers=layers))
                within.append((est.peak, est.recompute_flops + OFFLOAD * layers.count("offload")))
    tables = analytic_tables(TINY, WL, losses=LOSSES, offload=OFFLOAD)
    capped = 0
    for budget in _budgets([(p, c, False) for p, c in within]):
        got = plan(tables, budget, host_budget=host)
        assert got.cost == pytest.approx(min(c for p, c in within if p <= budget), rel=1e-12)
        assert got.layers.count("offload") <= cap and got.host <= host and got.peak <= budget
        capped += got.layers.count("offload") == cap
    assert capped  # the cap binds somewhere


def test_cli_says_what_offload_takes_of_host_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fast = dataclasses.replace(datasheet_device("h100-80gb"), host_link=1e13)
    fast.save(tmp_path / "fast.json")
    assert main(["plan", *GPT, "--budget", "20GiB", "--device-profile", str(tmp_path / "fast.json")]) == 0
    assert "of pinned host memory per GPU; cap it with --host-budget" in capsys.readouterr().out
    free = _plan_json(capsys, "--budget", "20GiB", "--device-profile", str(tmp_path / "fast.json"))
    half = free["predicted"]["host"] / 2
    capped = _plan_json(capsys, "--budget", "20GiB", "--device-profile", str(tmp_path / "fast.json"),
                        "--host-budget", str(half))  # fmt: skip
    assert 0 < capped["predicted"]["host"] <= half
    assert capped["policy"]["layers"].count("offload") < free["policy"]["layers"].count("offload")
    assert main(["plan", *GPT, "--budget", "20GiB", "--host-budget", "lots"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--host-budget 'lots' is not a size" in err
    assert main(["plan", *GPT, "--budget", "20GiB", "--host-budget", "8GiB", "--cost", "flops"]) == 0
    assert "--host-budget unused: the plan offloads nothing" in capsys.readouterr().out


def test_the_frontier_peaks_are_exact_offloading_plans_included() -> None:
    points = frontier(analytic_tables(TINY, WL, losses=LOSSES, offload=OFFLOAD))
    assert any("offload" in p.layers for p in points)
    for p in points:
        assert estimate(TINY, _mode(p.loss), Policy(layers=p.layers)).peak == pytest.approx(p.peak, rel=1e-12)


def test_offloaded_layers_go_first() -> None:
    points = frontier(analytic_tables(TINY, WL, offload=OFFLOAD))
    mixed = [p.layers for p in points if 0 < p.layers.count("offload") < TINY.n_layers]
    assert mixed
    for layers in mixed:
        k = layers.count("offload")
        assert layers[:k] == ("offload",) * k  # the bottom layers: their copies have the longest to hide


def test_offload_seconds_pinned() -> None:
    # 2 GB over 100 GB/s: 20 ms each way; a 10 ms forward hides half the copy out, a 50 ms backward all of it back
    assert offload_seconds(2e9, 0.010, 0.050, 1e11) == pytest.approx(0.010)
    assert offload_seconds(2e9, 0.030, 0.030, 1e11) == 0.0


# --- the command ----------------------------------------------------------------------------------------------

GPT = ["--model", "gpt2", "--seq-len", "1024", "--micro-batch", "8"]


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *GPT, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_chooses_the_chunked_loss_when_only_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    gpt, wl = ModelSpec.from_name("gpt2"), Workload(seq_len=1024, micro_batch=8)
    full = frontier(analytic_tables(gpt, wl))[0].peak
    chunked = frontier(analytic_tables(gpt, dataclasses.replace(wl, loss="chunked")))[0].peak
    assert chunked < full
    budget = str((full + chunked) / 2)
    data = _plan_json(capsys, "--budget", budget, "--cost", "flops")
    assert data["workload"]["loss"] == "chunked" and data["predicted"]["peak"] <= float(budget)
    assert {p["loss"] for p in data["frontier"]} == {"chunked"}  # in FLOPs it is free: its points dominate
    loose = _plan_json(capsys, "--budget", str(full * 2), "--cost", "flops")
    assert loose["workload"]["loss"] == "full"  # a tie keeps the loss the user has, and it is on the frontier
    assert any(p["loss"] == "full" and p["cost"] == loose["predicted"]["cost"] for p in loose["frontier"])
    assert main(["plan", *GPT, "--budget", str(full * 2), "--cost", "flops"]) == 0
    chosen = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("*"))
    assert "full" in chosen.split()
    assert main(["plan", *GPT, "--budget", budget, "--consider", "none"]) == 2  # recomputation alone: no fit
    assert "no plan fits" in capsys.readouterr().err


def test_cli_offloads_on_a_device_with_a_fast_host_link(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fast = dataclasses.replace(datasheet_device("h100-80gb"), host_link=1e13)  # copies hidden by any compute
    fast.save(tmp_path / "fast.json")
    data = _plan_json(capsys, "--budget", "20GiB", "--device-profile", str(tmp_path / "fast.json"))
    assert "offload" in data["policy"]["layers"]
    assert data["uniform"]["offload"]["cost"] == 0.0
    slow = _plan_json(capsys, "--budget", "20GiB", "--consider", "none")
    assert "offload" not in slow["policy"]["layers"] and "offload" not in slow["uniform"]


@pytest.mark.parametrize(
    ("argv", "note"),
    [
        (["--cost", "flops"], "offload not considered: its price is copy time, and costs are flops"),
        (["--gpu", "a100-80gb"], ""),
    ],
)
def test_cli_says_when_offload_is_not_priced(capsys: pytest.CaptureFixture[str], argv: list[str], note: str) -> None:
    assert main(["plan", *GPT, *argv, *(["--budget", "60GiB"] if "--gpu" not in argv else [])]) == 0
    out = capsys.readouterr().out
    assert (note in out) if note else ("offload not considered" not in out)


@pytest.mark.parametrize("value", ["sometimes", "", "none,offload"])
def test_cli_refuses_what_it_cannot_consider(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["plan", *GPT, "--budget", "60GiB", "--consider", value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--consider takes offload, chunked" in err

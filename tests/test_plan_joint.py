"""The joint planner (issue 15): per layer among keep, each recompute policy and offload, the loss mode as a
global choice; checked against brute force over every assignment and loss mode of a four-layer chain."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from recompute import ConfigError, ModelSpec, Policy, Workload, estimate
from recompute.cli import main
from recompute.core.analytic.memory import layer_activations
from recompute.core.hardware import datasheet_device
from recompute.core.plan import frontier, offload_seconds, plan
from recompute.core.policy import POLICIES

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
        got = plan(TINY, WL, budget, losses=LOSSES)
        assert got.cost == pytest.approx(best, rel=1e-12), budget
        assert got.estimate.peak <= budget and got.workload["loss"] in LOSSES
        chosen_modes.add(got.workload["loss"])
    assert chosen_modes == set(LOSSES)  # tight budgets take the chunked loss; loose ones keep the full (a tie)


def test_offload_plans_fit_and_are_never_worse(with_offload: list[tuple[float, float, bool]]) -> None:
    # the chain bounds a plan that offloads by one copied-back layer more than it may need: its smallest peak is
    # within that of the brute force's
    smallest = frontier(TINY, WL, offload=OFFLOAD, losses=LOSSES)[0].peak
    one_layer = layer_activations(TINY, WL).offloaded("offload")
    assert min(p[0] for p in with_offload) <= smallest <= min(p[0] for p in with_offload) + one_layer
    offloaded = 0
    for budget in _budgets([p for p in with_offload if p[0] >= smallest]):
        fits = [(cost, offloads) for peak, cost, offloads in with_offload if peak <= budget]
        got = plan(TINY, WL, budget, losses=LOSSES, offload=OFFLOAD)
        assert got.estimate.peak <= budget  # the chain's bound on the copied-back layer holds
        without = min(cost for cost, offloads in fits if not offloads)
        assert min(cost for cost, _ in fits) - 1e-3 <= got.cost <= without + 1e-3
        offloaded += "offload" in got.policy.per_layer(TINY.n_layers)
    assert offloaded  # some budget is met more cheaply by offloading than by recomputing


@pytest.mark.parametrize("cap", [1, 2])
def test_a_host_budget_caps_the_offloaded_layers(with_offload: list[tuple[float, float, bool]], cap: int) -> None:
    """Offloaded layers take pinned host memory: a plan offloads no more layers than the host budget holds, and is
    never costlier than recomputation alone nor cheaper than brute force over the assignments within the cap."""
    per_layer = layer_activations(TINY, WL).offloaded("offload")
    host = cap * per_layer * 1.001
    within = []
    for loss in LOSSES:
        for layers in itertools.product((*POLICIES, "offload"), repeat=TINY.n_layers):
            if layers.count("offload") <= cap:
                est = estimate(TINY, _mode(loss), Policy(layers=layers))
                within.append((est.peak, est.recompute_flops + OFFLOAD * layers.count("offload"), "offload" in layers))
    capped = planned = 0
    budgets = _budgets([p for p in with_offload if p[0] >= min(q[0] for q in within)])
    for budget in budgets:
        fits = [(cost, offloads) for peak, cost, offloads in within if peak <= budget]
        try:
            got = plan(TINY, WL, budget, losses=LOSSES, offload=OFFLOAD, host_budget=host)
        except ConfigError:  # the chain bounds an offloading plan by one copied-back layer: it may find none
            continue
        planned += 1
        layers = got.policy.per_layer(TINY.n_layers)
        assert layers.count("offload") <= cap and got.estimate.host <= host and got.estimate.peak <= budget
        without = min((cost for cost, offloads in fits if not offloads), default=float("inf"))
        assert min(cost for cost, _ in fits) - 1e-3 <= got.cost <= without + 1e-3
        capped += layers.count("offload") == cap
    assert capped and planned >= len(budgets) - 2  # the cap binds somewhere; only the tightest budgets find none


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


def test_the_frontier_bounds_each_offloading_plan_from_above() -> None:
    points = frontier(TINY, WL, offload=OFFLOAD, losses=LOSSES)
    assert any("offload" in p.layers for p in points)
    for p in points:
        exact = estimate(TINY, _mode(p.loss), Policy(layers=p.layers)).peak
        assert exact <= p.peak * (1 + 1e-12)
        if "offload" not in p.layers:
            assert exact == pytest.approx(p.peak, rel=1e-12)  # without offload the chain is exact


def test_offloaded_layers_go_first() -> None:
    mixed = [p.layers for p in frontier(TINY, WL, offload=OFFLOAD) if 0 < p.layers.count("offload") < TINY.n_layers]
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
    full = frontier(gpt, wl)[0].peak
    chunked = frontier(gpt, dataclasses.replace(wl, loss="chunked"))[0].peak
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

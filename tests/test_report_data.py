"""The report's series equal ``recompute.core.analytic`` (no plotly, no browser): the numbers behind every chart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from recompute import ModelSpec, Workload, estimate
from recompute.core.analytic import layer_overheads
from recompute.core.errors import ConfigError
from recompute.core.hardware import usable_bytes
from recompute.core.policy import POLICIES
from recompute.report.data import (
    COMPONENTS,
    _savings,
    build_report,
    components,
    family,
    sequence_lengths,
    worked_example,
)

LLAMA = ModelSpec.from_name("llama3.1-8b")
K = 1024


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_components_sum_to_the_estimate_total(policy: str, attention: str) -> None:
    est = estimate(LLAMA, Workload(seq_len=8 * K, attention=attention), policy)
    parts = components(est)
    assert list(parts) == list(COMPONENTS)
    assert sum(parts.values()) == pytest.approx(est.total, rel=1e-12)
    assert parts["attention"] == est.activations["attention"]
    assert parts["checkpoints"] == est.activations.get("checkpoint", 0.0)
    assert parts["outside"] == est.activations["embedding"] + est.activations["head"] + est.activations["logits"]


@pytest.mark.parametrize(
    ("name", "members"),
    [
        ("llama3.1-70b", ["llama3.1-8b", "llama3.1-70b", "llama3.1-405b"]),
        ("gpt2", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]),
        ("175b", ["22b", "175b", "530b", "1t"]),
        ("gpt3-175b", ["gpt3-175b"]),
    ],
)
def test_family_is_the_presets_with_the_same_source(name: str, members: list[str]) -> None:
    assert [s.name for s in family(ModelSpec.from_name(name))] == members


def test_a_custom_model_stands_alone() -> None:
    custom = dataclasses.replace(LLAMA, n_layers=4)
    assert family(custom) == (custom,)


def test_sequence_lengths() -> None:
    assert sequence_lengths(LLAMA, Workload(attention="eager")) == tuple(2**k * K for k in range(8))  # 1K ... 128K
    assert sequence_lengths(ModelSpec.from_name("gpt2"), Workload(attention="eager")) == (128, 256, 512, 1024)
    assert sequence_lengths(ModelSpec.from_name("22b"), Workload(attention="eager")) == (256, 512, 1024, 2048)
    assert sequence_lengths(LLAMA, Workload(attention="eager", tp=3, sp=True, seq_len=3 * K)) == ()


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    return build_report(LLAMA, Workload(attention="eager", seq_len=16 * K), gpu="a100-80gb")


@pytest.mark.parametrize("model", ["llama3.1-8b", "llama3.1-405b"])
@pytest.mark.parametrize(("attention", "policy", "seq_len"), [("eager", "none", 16 * K), ("flash", "attn", 128 * K)])
def test_memory_series_equal_the_estimate(report, model: str, attention: str, policy: str, seq_len: int) -> None:  # type: ignore[no-untyped-def]
    series = report.models[model]
    i = series.seq_lens.index(seq_len)
    mem = series.memory[attention][policy]
    est = estimate(ModelSpec.from_name(model), Workload(seq_len=seq_len, attention=attention), policy)
    assert mem.total[i] == est.total and mem.peak[i] == est.peak
    assert {k: v[i] for k, v in mem.components.items()} == components(est)


def test_overhead_series_equal_the_estimate(report) -> None:  # type: ignore[no-untyped-def]
    series = report.models["llama3.1-70b"]
    spec = ModelSpec.from_name("llama3.1-70b")
    for i, s in enumerate(series.seq_lens):
        for policy in POLICIES:
            assert series.overhead[policy][i] == estimate(spec, Workload(attention="eager", seq_len=s), policy).overhead
            assert (
                series.layer_overhead[policy][i]
                == layer_overheads(spec, Workload(attention="eager", seq_len=s))[policy]
            )


def test_savings_table_matches_the_readme(report) -> None:  # type: ignore[no-untyped-def]
    # README: llama3.1-8b at 16K, eager: core_attn 84.40, attn 36.23, mlp 5.27 GiB per 1 % of overhead.
    rows = {r.policy: r for r in report.models["llama3.1-8b"].savings["eager"]}
    assert list(rows) == [*(p for p in POLICIES if p != "none"), "chunked loss", "offload"]
    assert [round(rows[p].per_percent / 2**30, 2) for p in ("core_attn", "attn", "mlp")] == [84.40, 36.23, 5.27]
    base = estimate(LLAMA, Workload(attention="eager", seq_len=16 * K), "none").activation_bytes
    mlp = estimate(LLAMA, Workload(attention="eager", seq_len=16 * K), "mlp")
    assert rows["mlp"].saved == base - mlp.activation_bytes and rows["mlp"].overhead == mlp.overhead
    assert report.models["llama3.1-8b"].activations["eager"] == base
    chunked = estimate(LLAMA, Workload(attention="eager", seq_len=16 * K, loss="chunked"), "none")
    assert rows["chunked loss"].saved == base - chunked.activation_bytes > 0
    assert rows["chunked loss"].overhead == 0 and rows["chunked loss"].per_percent is None  # nothing replayed
    offload = estimate(LLAMA, Workload(attention="eager", seq_len=16 * K), "offload")
    assert rows["offload"].saved == base - offload.activation_bytes > rows["block"].saved  # and no FLOPs
    assert rows["offload"].overhead == 0 and rows["offload"].per_percent is None


def test_worked_example() -> None:
    w = worked_example()
    assert (w.attention, w.mlp, w.step) == (100, 300, 1200)
    assert [round(100 * v, 1) for v in w.rows.values()] == [8.3, 25.0, 33.3]


def test_gpu_line_and_json(report) -> None:  # type: ignore[no-untyped-def]
    assert report.gpu.name == "a100-80gb" and report.gpu.usable == usable_bytes("a100-80gb")
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert list(data["models"]) == ["llama3.1-8b", "llama3.1-70b", "llama3.1-405b"]
    assert data["models"]["llama3.1-8b"]["table_seq_len"] == 16 * K


def test_sizes_the_workload_cannot_run_are_listed_not_fatal() -> None:
    report = build_report(ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=1024, tp=4))
    assert list(report.models) == ["gpt2", "gpt2-medium", "gpt2-large"]
    assert report.skipped == {"gpt2-xl": "tp 4 must divide the 25 query heads of gpt2-xl"}


def test_the_chosen_model_must_run() -> None:
    with pytest.raises(ConfigError, match="must divide the 25 query heads"):
        build_report(ModelSpec.from_name("gpt2-xl"), Workload(attention="eager", seq_len=1024, tp=4))
    with pytest.raises(ConfigError, match="not a known GPU"):
        build_report(LLAMA, Workload(attention="eager"), gpu="b300")


def test_fp16_has_no_chunked_loss_row() -> None:
    """The chunked loss refuses fp16 (its gradients, taken in the forward, would underflow before a loss scaler)."""
    rows = [r.policy for r in _savings(LLAMA, Workload(dtype="fp16", seq_len=4 * K))]
    assert "chunked loss" not in rows and rows[-1] == "offload"

"""The analytic per-layer bytes against the trace: a representative subset of ``recompute validate``.

The full table (every preset x policy x attention at two lengths) is ``recompute validate``; its figures are in
docs/validation.md. This runs GPT-2, Llama-3.1-8B and the paper's 22B at both lengths, every policy and both
attention implementations, and pins the agreement as exact.
"""

from __future__ import annotations

import json

import pytest

from recompute.check_formulas import (
    TARGETS,
    Validation,
    ValidationRow,
    analytic_components,
    render_validation,
    validate,
)
from recompute.cli import main
from recompute.core.analytic import layer_activations
from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload


@pytest.fixture(scope="module")
def table() -> Validation:
    return validate(["gpt2", "llama3.1-8b", "22b"])


def test_every_configuration_is_covered(table: Validation) -> None:
    assert len(table.rows) == 3 * 2 * 2 * 6
    assert {r.seq_len for r in table.rows if r.model == "llama3.1-8b"} == {4096, 8192}
    assert {r.seq_len for r in table.rows if r.model == "gpt2"} == {512, 1024}


def test_analytic_layer_bytes_equal_the_trace(table: Validation) -> None:
    """Exact, component by component: the targets (3 % GPT, 5 % Llama) hold with room to spare."""
    for r in table.rows:
        assert r.analytic == pytest.approx(r.traced, rel=1e-12, abs=0), (r.model, r.seq_len, r.attention, r.policy)
    assert table.passed
    assert table.max_error("gpt") <= TARGETS["gpt"] and table.max_error("llama") <= TARGETS["llama"]


@pytest.mark.parametrize(
    ("fam", "off", "passed"), [("gpt", 1.04, False), ("llama", 1.04, True), ("llama", 0.94, False)]
)
def test_targets_decide_pass_or_fail(fam: str, off: float, passed: bool) -> None:
    traced = {"attention": 100, "mlp": 200, "norms": 100, "checkpoint": 0}
    analytic = {k: off * v for k, v in traced.items()}
    row = ValidationRow("m", fam, "none", "eager", 1024, 1, analytic, traced)
    assert row.error == pytest.approx(off - 1) and row.passed is passed
    assert Validation((row,)).passed is passed


def test_sub_block_checkpoints_count_with_their_sub_block() -> None:
    """The trace files the input an attention/MLP checkpoint keeps under that sub-block; only block's is apart."""
    la = layer_activations(ModelSpec.from_name("gpt2"), Workload(seq_len=1024, device="cpu"))
    assert analytic_components(la, "attn")["attention"] == la.attn_in
    assert analytic_components(la, "attn+mlp") == {
        "attention": la.attn_in, "mlp": la.mlp_in, "norms": la.norms + la.norm_stats, "checkpoint": 0.0
    }  # fmt: skip
    assert analytic_components(la, "block") == {"attention": 0, "mlp": 0, "norms": 0, "checkpoint": la.layer_in}


PHASES = {
    "loss": "backward (head and loss)",
    "optimizer step": "optimizer step",
    "backward of the embedding": "backward (embedding)",
}


@pytest.mark.parametrize("keep_grads", [False, True], ids=["gradients freed", "gradients kept"])
def test_step_peak_matches_the_estimate(keep_grads: bool) -> None:
    """The analytic peak is the trace's, at the same phase, whether zero_grad() frees the gradients or not."""
    v = validate(
        ["gpt2", "llama3.1-8b"],
        policies=["none", "block"],
        attentions=["flash"],
        lengths=[1024],
        peaks=True,
        keep_grads=keep_grads,
    )
    assert len(v.peaks) == 4
    for r in v.peaks:
        assert r.analytic == pytest.approx(r.traced, rel=1e-4), (r.model, r.policy)
        assert PHASES.get(r.analytic_phase, r.analytic_phase) == r.traced_phase, (r.model, r.policy)
    assert "gpt peaks: max |error| 0.00%" in render_validation(v)
    # Llama's block step peaks in the optimizer step either way: every gradient, AdamW's temporaries and the logits
    # the training loop holds until the step ends (0.24 GiB at s = 1024) outweigh its loss phase.
    assert {r.analytic_phase for r in v.peaks} == {"loss", "optimizer step"}


def test_render_and_cli(table: Validation, capsys: pytest.CaptureFixture[str]) -> None:
    text = render_validation(table, components=True)
    assert "gpt: max |error| 0.00% (target 3%)" in text and "all within target" in text
    argv = ["validate", "--models", "gpt2", "--policies", "none,block", "--attention", "flash", "--seq-lens", "256"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and len(data["rows"]) == 2 and data["max_error"] == {"gpt": 0.0}


def test_bad_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--models", "gpt5"]) == 2
    assert "is not a known model" in capsys.readouterr().err

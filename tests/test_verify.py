"""``verify`` and ``recompute verify``: equal runs pass (exit 0), runs that differ fail (exit 1), bad input 2."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from recompute import Policy
from recompute.check_gradients import GroupDiff, VerifyResult, render_verify, verify, verify_spec
from recompute.cli import main
from recompute.models import build_model
from recompute.models.hf import build_hf_model
from tiny import tiny_gpt

GPT = tiny_gpt()
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "32"]


@pytest.fixture
def masks_do_not_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break recomputation on purpose: without the saved RNG state the replayed dropout draws new masks."""
    monkeypatch.setattr(
        sys.modules["recompute.checkpointing"], "checkpoint", functools.partial(checkpoint, preserve_rng_state=False)
    )


@pytest.mark.parametrize("policy", ["core_attn", "attn+mlp", Policy("block", every=2, save_ops=("aten.mm",))])
def test_verify_passes_bit_exact_with_dropout(policy: str | Policy) -> None:
    torch.manual_seed(0)
    result = verify(build_model(GPT, attention="eager"), policy, seq_len=32)
    assert result.passed and result.bit_exact and result.repeatable
    assert result.loss_diff == 0 and result.max_grad_diff == 0
    assert [g.name for g in result.groups] == [
        "tok_emb",
        "pos_emb",
        *(f"layers.*.{c}" for c in ("norm1", "attn", "norm2", "mlp")),
        "norm",
    ]


def test_verify_runs_hf_models_and_leaves_the_policy_applied() -> None:
    torch.manual_seed(0)
    model = build_hf_model(GPT, attention="eager")
    result = verify(model, "block", seq_len=32)
    assert result.passed and result.bit_exact
    assert "transformer.h.*.attn" in {g.name for g in result.groups}
    from recompute.checkpointing import applied_policy

    assert applied_policy(model) == Policy("block")


def test_verify_catches_masks_that_do_not_replay(masks_do_not_replay: None) -> None:
    torch.manual_seed(0)
    result = verify(build_model(GPT, attention="eager"), "block", seq_len=32)
    assert not result.passed and not result.bit_exact
    assert result.loss_diff == 0  # the forward is untouched; the backward uses other masks
    differs = {g.name for g in result.groups if not g.within_tol}
    assert "layers.*.attn" in differs and "layers.*.mlp" in differs
    assert "DIFFERS" in render_verify(result) and "FAIL" in render_verify(result)


def test_cli_verify_passes_and_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--model", "gpt2", *SMALL, "--policy", "core_attn"]) == 0
    out = capsys.readouterr().out
    assert "verify gpt2 (2 layers, h=64), policy core_attn: PASS" in out
    assert "two runs with the policy: bit-identical" in out


@pytest.mark.parametrize("model", ["hf:gpt2", "hf:llama"])
def test_cli_verify_hf_models_as_json(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--kv-heads", "2"] if model == "hf:llama" else []
    assert main(["verify", "--model", model, *SMALL, *extra, "--policy", "attn", "--every", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and data["bit_exact"] and data["policy"] == "attn every 2 layers"


def test_cli_verify_exits_1_when_results_differ(masks_do_not_replay: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--model", "gpt2", *SMALL, "--policy", "mlp"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt5"], "'gpt5' is not a known model"),
        (["--model", "llama3.1-70b"], "too many to run real steps of here; shrink it"),
        (["--model", "gpt2", "--heads", "5"], "n_heads (5) must divide hidden (768)"),
        (
            ["--model", "hf:llama", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "3"],
            "n_kv_heads (3) must divide",
        ),
        (["--model", "gpt2", *SMALL, "--policy", "everything"], "'everything' is not a policy"),
    ],
    ids=["unknown-model", "too-big", "bad-heads", "bad-kv-heads", "bad-policy"],
)
def test_cli_verify_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_overrides_re_derive_widths() -> None:
    spec, hf = verify_spec("hf:llama", n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, vocab=None)
    assert hf and spec.name == "llama3.1-8b" and spec.vocab == 128256
    assert (spec.n_layers, spec.hidden, spec.head_dim, spec.n_kv_heads, spec.d_ff) == (2, 256, 32, 2, 768)
    spec, hf = verify_spec("gpt2", n_heads=4, n_layers=None, hidden=None, n_kv_heads=None, vocab=None)
    assert not hf and (spec.n_heads, spec.n_kv_heads, spec.head_dim) == (4, 4, 192)


def test_render_shows_groups_and_verdict() -> None:
    result = VerifyResult(
        model="m",
        policy="block",
        loss_ref=1.0,
        loss=1.0,
        loss_within_tol=True,
        groups=(GroupDiff("layers.*.attn", 0.5, 1.0, False), GroupDiff("norm", 0.0, 1.0, True)),
        bit_exact=False,
        repeatable=True,
        rtol=1e-6,
        atol=1e-5,
    )
    text = render_verify(result)
    assert text.splitlines()[0] == "verify m, policy block: FAIL"
    assert "layers.*.attn" in text and "DIFFERS" in text and "bit-identical" in text
    assert result.to_dict()["max_grad_diff"] == 0.5 and not result.to_dict()["passed"]

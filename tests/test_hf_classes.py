"""A fast subset of ``benchmarks/hf_fidelity.py --classes``: transformers' classes built from their config classes'
defaults, held to recompute's figures (parameters at the default size; per-layer saved bytes and gradients under
every policy on a shrunk copy run for real here). The whole sweep and its table: docs/validation.md."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_fidelity


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The shrunk models are tiny: one thread is several times faster than two on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def checked(model_type: str) -> dict[str, Any]:
    row = hf_fidelity.check_class(model_type)
    assert row["status"] == "exact", row
    assert row["parameters"]["trace"] == row["parameters"]["class"]
    assert row["layers"]["trace"] == row["layers"]["real"]
    return row


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_a_covered_class_is_exact_everywhere(model_type: str) -> None:
    row = checked(model_type)
    assert row["parameters"]["analytic"] == row["parameters"]["class"]
    assert {name for name, v in row["policies"].items() if v != "bit-exact"} == {"experts"}  # a dense MLP


def test_falcon_refuses_core_attn_and_is_exact_otherwise() -> None:
    row = checked("falcon")
    assert row["policies"]["core_attn"].startswith("refused: core_attn cannot apply to FalconAttention")
    assert "attention and MLP in parallel" in row["parameters"]["analytic"]


def test_deepseek_v3_dense_first_moe() -> None:
    """671B parameters from a trace of 2 + 2 and 2 + 3 layers scaled run by run (the issue's 37.4B before)."""
    row = checked("deepseek_v3")
    assert row["parameters"]["class"] == 671_026_404_352
    assert "low-rank latent attention" in row["parameters"]["analytic"]
    assert row["policies"]["experts"].startswith("refused: the 'experts' policy")  # layer 0 is dense: not uniform
    assert all(v == "bit-exact" for name, v in row["policies"].items() if name != "experts")


@pytest.mark.parametrize(("model_type", "says"), [("bart", "encoder-decoder"), ("bert", "encoder-only")])
def test_what_recompute_does_not_build_is_refused_with_the_reason(model_type: str, says: str) -> None:
    row = hf_fidelity.check_class(model_type)
    assert row["status"] == "refused" and says in row["why"]


@pytest.mark.parametrize(
    "model_type",
    [
        "glm4_moe_lite",  # latent attention: 20 heads do not divide the width 2048, and need not
        "xlnet",  # max_position_embeddings -1: no limit
    ],
)
def test_classes_the_sweep_found_refused_wrongly_are_exact(model_type: str) -> None:
    checked(model_type)


def test_an_mlp_width_per_layer_is_taken() -> None:
    """Gemma 3n states ``intermediate_size`` per layer (the whole class takes minutes here: its source only)."""
    import transformers

    from recompute.models.source import ModelSource

    raw = transformers.AutoConfig.for_model("gemma3n_text").to_dict()
    assert isinstance(raw["intermediate_size"], list)
    assert ModelSource.from_config(hf_fidelity.shrunk("gemma3n_text", raw), name="gemma3n_text").config is not None


@pytest.mark.parametrize(
    ("model_type", "trace"),
    [
        ("dory", [246528, 488960, 244480]),  # deep-copies its cache layers: fake tensors deep-copy as real ones
        ("gemma4_text", [511744, 321280, 321280, 321280, 321280, 2289408]),  # layer 0 without the embedded tokens
    ],
)
def test_the_classes_the_sweep_found_off_are_exact(model_type: str, trace: list[int]) -> None:
    """Per-layer bytes of the shrunk copy, trace against a real step, each storage by its first saver: Gemma 4's
    per-layer input projection saves the embedded tokens before layer 0 does (the embedding's, not layer 0's)."""
    import transformers

    from recompute.models.source import ModelSource, build_source
    from recompute.trace import trace as run_trace

    raw = transformers.AutoConfig.for_model(model_type).to_dict()
    small = ModelSource.from_config(hf_fidelity.shrunk(model_type, raw), name=model_type)
    torch.manual_seed(0)
    built = build_source(small)
    idx, targets = torch.randint(built.vocab, (2, hf_fidelity.CLASS_WL.micro_batch, hf_fidelity.CLASS_WL.seq_len))
    assert hf_fidelity.real_kept(built, idx, targets, backward=False) == trace
    assert [p.total for p in run_trace(small, hf_fidelity.CLASS_WL, "none").layers] == trace

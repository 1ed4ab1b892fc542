"""The trace against a real step of transformers' own class (issue 37), measured apart from recompute's tracker.

``benchmarks/real_saved.py`` runs the class on real tensors and counts what autograd saves with a plain
``saved_tensors_hooks`` pack hook, once per storage, no weights; one layer's bytes are the difference between
the model at 2 layers and at 1. The trace's figure is the same difference of its fake steps. Small widths, bf16,
the real code path: with and without the key/value cache (``use_cache=False`` is the path on which transformers
asks whether the position ids are packed, which it cannot read on fake tensors).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from recompute.trace._hf_path import real_step_path

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import real_saved  # noqa: E402  (benchmarks/ is not a package)

SMALL = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
CLASSES: dict[str, dict[str, Any]] = {
    "phi3": {"model_type": "phi3", **SMALL},  # fused Q/K/V and gate/up
    "gpt_neox": {"model_type": "gpt_neox", "rotary_pct": 0.25, "use_parallel_residual": True, **SMALL},
    "llama_gqa": {"model_type": "llama", "num_key_value_heads": 2, **SMALL},  # SDPA's enable_gqa needs no mask
}


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_one_layer_of_the_trace_is_what_a_real_step_saves(name: str, use_cache: bool) -> None:
    raw = {**CLASSES[name], "use_cache": use_cache}
    shape: dict[str, Any] = {"dtype": "bf16", "seq_len": 32, "micro_batch": 1}
    real = real_saved.real_per_layer(name, raw, **shape).per_layer
    assert real > 0
    assert real_saved.traced_per_layer(name, raw, **shape) == real


def test_without_a_cache_a_fused_qkv_keeps_its_whole_output() -> None:
    """Phi-3 without a cache: v is a view of the fused Q/K/V output, so its q and k parts stay (2·s·h·e more than
    with the cache's copies): the issue's 161,619,968 B at published width, here at a small one."""
    shape: dict[str, Any] = {"dtype": "bf16", "seq_len": 32, "micro_batch": 1}
    with_cache, without = (
        real_saved.real_per_layer("phi3", {**CLASSES["phi3"], "use_cache": c}, **shape).per_layer for c in (True, False)
    )
    assert without - with_cache == 2 * 32 * 128 * 2


def test_the_packed_sequence_check_reads_real_position_ids_as_transformers_does() -> None:
    """Only fake position ids get the real step's answer; real ones (packed here) keep transformers' own."""
    from transformers import masking_utils

    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    before = masking_utils.find_packed_sequence_indices
    with real_step_path():
        assert masking_utils.find_packed_sequence_indices is not before
        found = masking_utils.find_packed_sequence_indices(packed)
        assert found is not None and found.tolist() == [[0, 0, 0, 1, 1, 1]]
        assert masking_utils.find_packed_sequence_indices(torch.arange(6)[None]) is None
    assert masking_utils.find_packed_sequence_indices is before


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("name", ["phi3", "gpt_neox"])
def test_the_analytic_layer_is_what_a_real_step_saves(name: str, use_cache: bool) -> None:
    """The formulas of these two classes, with and without the cache, held to the real step (not to the trace)."""
    from recompute import Workload
    from recompute.core.analytic import layer_activations
    from recompute.core.spec import spec_from_config

    raw = {**CLASSES[name], "use_cache": use_cache}
    real = real_saved.real_per_layer(name, raw, dtype="bf16", seq_len=32).per_layer
    wl = Workload(seq_len=32, micro_batch=1, dtype="bf16", attention="flash", device="cpu")
    assert layer_activations(spec_from_config({**raw, "num_hidden_layers": 2}), wl, 1).stored("none") == real

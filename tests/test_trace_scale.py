"""Tracing K and K + 1 identical layers and scaling gives every figure of the full trace, byte for byte."""

from __future__ import annotations

import dataclasses

import pytest

from recompute import ModelSpec, Workload
from recompute.trace import trace

GPT = ModelSpec(hidden=64, n_layers=6, n_heads=4, vocab=128, max_positions=64)
LLAMA = dataclasses.replace(
    GPT, mlp="swiglu", norm="rmsnorm", position="rotary", n_kv_heads=2, d_ff=0, dropout=0.0, bias=False
)
WL = Workload(attention="eager", micro_batch=2, seq_len=64, dtype="fp32", device="cpu")
SAME = ("parameters", "gradients", "optimizer", "other", "layers", "embedding", "head", "peak", "peak_phase")
SAME += ("peak_breakdown", "phases", "per_layer", "n_layers", "policy", "model", "workload")


@pytest.mark.parametrize(
    ("name", "policy", "k"),
    [("gpt", "none", 1), ("gpt", "block", 2), ("llama", "attn", 2), ("llama", "none", 3)],
)
def test_scaled_trace_equals_full_trace(name: str, policy: str, k: int) -> None:
    spec = GPT if name == "gpt" else LLAMA
    full, scaled = trace(spec, WL, policy), trace(spec, WL, policy, layers=k)
    assert full.traced == (6,) and scaled.traced == (k, k + 1) and scaled.scaled
    for figure in SAME:
        assert getattr(scaled, figure) == getattr(full, figure), figure
    assert any("scaled every figure to 6" in n for n in scaled.notes)


def test_layers_at_or_above_the_model_depth_trace_everything() -> None:
    assert trace(GPT, WL, "none", layers=5).traced == (6,)

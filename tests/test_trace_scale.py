"""Tracing K and K + 1 identical layers and scaling gives every figure of the full trace, byte for byte; so does
scaling each run of alike layers of a model whose layers differ (dense-first MoE, full-then-sliding attention)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from recompute import ModelSpec, Workload
from recompute.checkpointing import find_layers
from recompute.core.errors import ConfigError
from recompute.models.source import ModelSource, build_source, resolve_source
from recompute.trace import step_work, trace
from recompute.trace._kinds import layer_kinds

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


# --- layers that differ: runs of alike layers, scaled run by run ------------------------------------------

transformers = pytest.importorskip("transformers")

HF = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MIXED: dict[str, dict[str, Any]] = {
    "deepseek_v3": {  # DeepSeek-V3's shape: latent attention, dense layers first, then routed + shared experts
        **HF, **MOE, "num_hidden_layers": 8, "first_k_dense_replace": 2, "n_routed_experts": 4, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4,
    },
    "qwen3_moe": {**HF, **MOE, "num_hidden_layers": 8, "num_experts": 4, "head_dim": 16, "mlp_only_layers": [0, 1]},
    "qwen2": {**HF, "num_hidden_layers": 8, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3},
}  # fmt: skip
"""Eight layers in two runs: two dense then six MoE (DeepSeek-V3, Qwen3-MoE's mlp_only_layers); three full-attention
then five sliding-window layers (Qwen2's layer_types)."""
HF_WL = Workload(seq_len=32, micro_batch=2, dtype="fp32", attention="flash", device="cpu")


def mixed(kind: str, folder: Path, **changes: Any) -> ModelSource:
    path = folder / f"{kind}.json"
    path.write_text(json.dumps({"model_type": kind, **MIXED[kind], **changes}))
    return resolve_source(str(path))


@pytest.mark.parametrize(
    ("kind", "policy", "k"),
    [
        ("deepseek_v3", "none", 2),
        ("deepseek_v3", "block", 1),
        ("deepseek_v3", "offload", 3),
        ("qwen3_moe", "attn", 2),
        ("qwen3_moe", "mlp", 1),
        ("qwen2", "none", 1),
        ("qwen2", "core_attn", 2),
    ],
)
def test_runs_of_alike_layers_scale_exactly(kind: str, policy: str, k: int, tmp_path: Path) -> None:
    """Dense-first MoE and full-then-sliding models: every figure of the scaled trace equals the full trace's."""
    source = mixed(kind, tmp_path)
    full, scaled = trace(source, HF_WL, policy), trace(source, HF_WL, policy, layers=k)
    assert full.traced == (8,) and scaled.scaled and max(scaled.traced) < 8
    for figure in (*SAME, "parameter_count"):
        assert getattr(scaled, figure) == getattr(full, figure), figure
    note = scaled.notes[-1]
    assert note.startswith("layers differ (") and "(layers 0-" in note and "scaled every figure to 8" in note
    assert not any("identical" in n for n in scaled.notes)


def test_dense_first_layers_are_a_kind_of_their_own(tmp_path: Path) -> None:
    """DeepSeek-V3's dense layers and MoE layers are two kinds, in two runs; two traces scale the MoE run."""
    source = mixed("deepseek_v3", tmp_path)
    built = build_source(source, device="meta")
    kinds = layer_kinds(built.model, find_layers(built.model))
    assert kinds.kind_of == (0, 0, 1, 1, 1, 1, 1, 1)
    assert "DeepseekV3MLP (layers 0-1)" in kinds.describe() and "DeepseekV3MoE (layers 2-7)" in kinds.describe()
    assert trace(source, HF_WL, "none", layers=2).traced == (4, 5)  # 2 dense + 2 MoE, then 2 dense + 3 MoE


def test_settings_that_differ_make_kinds(tmp_path: Path) -> None:
    """SmolLM3's no-rope layers have the same parameters as the others: their ``use_rope`` tells them apart."""
    raw = {"model_type": "smollm3", **HF, "num_hidden_layers": 8, "no_rope_layer_interval": 4}
    (tmp_path / "smollm3.json").write_text(json.dumps(raw))
    built = build_source(resolve_source(str(tmp_path / "smollm3.json")), device="meta")
    kinds = layer_kinds(built.model, find_layers(built.model))
    assert kinds.kind_of == (0, 0, 0, 1, 0, 0, 0, 1)


def test_layers_that_alternate_are_refused_in_one_line(tmp_path: Path) -> None:
    """Gemma 2 alternates sliding-window and full attention: no run to scale; the refusal names the layers."""
    raw = {"model_type": "gemma2", **HF, "head_dim": 16, "num_hidden_layers": 6}
    (tmp_path / "gemma2.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        trace(str(tmp_path / "gemma2.json"), HF_WL, "none", layers=2)
    message = str(e.value)
    assert "\n" not in message and "no run is longer than 3" in message
    assert "sliding_attention, Gemma2MLP (layers 0, 2, 4)" in message and "trace every layer instead" in message


def test_many_short_runs_are_refused(tmp_path: Path) -> None:
    """Scaling every run would trace over twice the model's layers: refused, naming the runs."""
    source = mixed("qwen3_moe", tmp_path, mlp_only_layers=[0, 4, 8], num_hidden_layers=12)
    with pytest.raises(
        ConfigError, match=r"in 6 runs .*: scaling would trace 27 layers, more than twice the model's 12"
    ):
        trace(source, HF_WL, "none", layers=1)


def test_step_work_of_layers_that_differ_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="identical layers, but deepseek_v3's layers differ"):
        step_work(mixed("deepseek_v3", tmp_path), HF_WL, "none", layers=2)

"""Model presets: one row per model, listing only what differs from ``ModelSpec``'s GPT-2-style defaults.

Every row names its source. Variants of a family are made by a loop, not by copying rows.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_GPT2_SOURCE = "karpathy/nanoGPT model.py from_pretrained; Radford et al. 2019"
_LLAMA_SOURCE = "meta-llama/llama-models models/sku_list.py; HF config.json of meta-llama/Llama-3.1-*"
_PAPER_SOURCE = "Korthikanti et al. 2022 (arXiv 2205.05198) Table 3; v = 51200, s = 2048, FFN = 4h"

_LLAMA: dict[str, Any] = dict(
    vocab=128256,
    mlp="swiglu",
    norm="rmsnorm",
    position="rotary",
    dropout=0.0,
    tied_embeddings=False,
    bias=False,
    max_positions=131072,
    norm_eps=1e-5,
    rope_theta=500000.0,
    source=_LLAMA_SOURCE,
)
_PAPER: dict[str, Any] = dict(vocab=51200, max_positions=2048, source=_PAPER_SOURCE)

PRESETS: dict[str, dict[str, Any]] = {}

# GPT-2 family: LayerNorm, GELU, learned positions, tied embeddings, dropout 0.1, context 1024.
for _name, _L, _h, _a in [
    ("gpt2", 12, 768, 12),
    ("gpt2-medium", 24, 1024, 16),
    ("gpt2-large", 36, 1280, 20),
    ("gpt2-xl", 48, 1600, 25),
]:
    PRESETS[_name] = dict(n_layers=_L, hidden=_h, n_heads=_a, source=_GPT2_SOURCE)

# Llama 3.1: RMSNorm, SwiGLU, GQA with 8 KV heads, rotary embeddings, no dropout, untied embeddings.
for _name, _L, _h, _a, _ff in [
    ("llama3.1-8b", 32, 4096, 32, 14336),
    ("llama3.1-70b", 80, 8192, 64, 28672),
    ("llama3.1-405b", 126, 16384, 128, 53248),
]:
    PRESETS[_name] = dict(_LLAMA, n_layers=_L, hidden=_h, n_heads=_a, n_kv_heads=8, d_ff=_ff)

# GPT-3 175B as published (dense attention, as Megatron and Korthikanti model it).
PRESETS["gpt3-175b"] = dict(
    n_layers=96,
    hidden=12288,
    n_heads=96,
    max_positions=2048,
    source="Brown et al. 2020 Table 2.1; NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh",
)

# The paper's four configurations (Table 3).
for _name, _L, _h, _a in [
    ("22b", 48, 6144, 64),
    ("175b", 96, 12288, 96),
    ("530b", 105, 20480, 128),
    ("1t", 128, 25600, 160),
]:
    PRESETS[_name] = dict(_PAPER, n_layers=_L, hidden=_h, n_heads=_a)

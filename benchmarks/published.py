"""Transformers configs of published models, at their published sizes: the benchmarks' shared data.

No transformers import: a script that builds them (``hf_fidelity.py``, ``gpu_truth.py``) needs it, one that only
reads the sizes does not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODELS"]

MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    "Qwen2.5-7B": dict(  # Qwen/Qwen2.5-7B
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
    ),
    "Mistral-7B-v0.1": dict(  # mistralai/Mistral-7B-v0.1
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
        max_position_embeddings=32768,
    ),
    "Gemma-2-9B": dict(  # google/gemma-2-9b
        model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
    ),
    "Phi-3-mini-4k": dict(  # microsoft/Phi-3-mini-4k-instruct
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
    ),
    "OLMo-2-7B": dict(  # allenai/OLMo-2-1124-7B
        model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
    ),
    "Mixtral-8x7B": dict(  # mistralai/Mixtral-8x7B-v0.1
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768,
    ),
    "Qwen3-30B-A3B": dict(  # Qwen/Qwen3-30B-A3B
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
    ),
    "Pythia-1B": dict(  # EleutherAI/pythia-1b
        model_type="gpt_neox", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=8, vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048,
    ),
    "GPT-2": dict(  # openai-community/gpt2
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
    ),
}  # fmt: skip
"""Published sizes (each model's config.json on the Hub). GPT-2's 1024 positions cap its sequence."""

"""Hugging Face models from a ``ModelSpec``, built from their config classes: random weights, no download.

``GPT2LMHeadModel`` for GPT-style specs and ``LlamaForCausalLM`` for Llama-style ones, so the same shape can
be run through recompute's reference models and through transformers. Needs ``transformers``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from recompute.core.errors import ConfigError, first_line, one_of
from recompute.core.spec import HF_ALIASES, ModelSpec

__all__ = ["HF_ALIASES", "HF_ATTENTION", "build_hf_model", "hf_class_name", "hf_config", "transformers_module"]

HF_ATTENTION = {"eager": "eager", "flash": "sdpa"}
"""recompute's attention names and the ``attn_implementation`` they map to."""


def transformers_module() -> ModuleType:
    """``transformers``, or one line naming the extra that installs it (a config.json ended in a raw
    ModuleNotFoundError after the README's install line, issue 36).

    Raises:
        ConfigError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"a transformers model (a config.json, hf:NAME) needs the transformers package ({first_line(e)}); "
            "install it with: pip install 'recompute[hf]'"
        ) from None
    return transformers


def hf_config(spec: ModelSpec, *, attention: str = "flash") -> Any:
    """A ``GPT2Config`` (GELU, LayerNorm, learned positions) or ``LlamaConfig`` (SwiGLU, RMSNorm, RoPE).

    Raises:
        ConfigError: a spec that is neither GPT-2 nor Llama shaped.
    """
    transformers = transformers_module()

    # Not in the config classes' typed signatures, but every PretrainedConfig takes it.
    extra: dict[str, Any] = {
        "attn_implementation": HF_ATTENTION[one_of("attention", attention, tuple(HF_ATTENTION))],
        "use_cache": spec.kv_cache,  # what its training step builds (Note: [the key/value cache changes a step])
    }
    if (spec.mlp, spec.norm, spec.position) == ("gelu", "layernorm", "learned") and spec.n_kv_heads == spec.n_heads:
        return transformers.GPT2Config(
            vocab_size=spec.vocab,
            n_positions=spec.max_positions,
            n_embd=spec.hidden,
            n_layer=spec.n_layers,
            n_head=spec.n_heads,
            n_inner=spec.d_ff,
            resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout,
            attn_pdrop=spec.dropout,
            layer_norm_epsilon=spec.norm_eps,
            tie_word_embeddings=spec.tied_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            **extra,
        )
    if (spec.mlp, spec.norm, spec.position) == ("swiglu", "rmsnorm", "rotary"):
        return transformers.LlamaConfig(
            vocab_size=spec.vocab,
            hidden_size=spec.hidden,
            intermediate_size=spec.d_ff,
            num_hidden_layers=spec.n_layers,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_positions,
            rms_norm_eps=spec.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            attention_dropout=spec.dropout,
            attention_bias=spec.bias,
            mlp_bias=spec.bias,
            tie_word_embeddings=spec.tied_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            **extra,
        )
    raise ConfigError(
        f"no Hugging Face class for a {spec.mlp}/{spec.norm}/{spec.position} spec with {spec.n_kv_heads} KV heads; "
        "use a GPT-2 shaped (gelu, layernorm, learned, MHA) or Llama shaped (swiglu, rmsnorm, rotary) spec"
    )


def hf_class_name(spec: ModelSpec) -> str:
    """The transformers class ``build_hf_model`` builds for ``spec``."""
    return "GPT2LMHeadModel" if spec.mlp == "gelu" else "LlamaForCausalLM"


def build_hf_model(
    spec: ModelSpec,
    *,
    attention: str = "flash",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` for ``spec`` (no download).

    ``attention`` is ``eager`` or ``flash`` (HF's ``sdpa``).
    """
    transformers = transformers_module()

    config = hf_config(spec, attention=attention)
    cls = getattr(transformers, hf_class_name(spec))
    with torch.device(device):
        model = cls(config)
    return model.to(dtype=dtype)

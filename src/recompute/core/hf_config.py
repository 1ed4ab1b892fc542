"""Reading a transformers config into ``ModelSpec`` fields, architecture by architecture, or refusing it.

Pure standard library (no transformers import): each ``model_type`` the analytic model covers has a row in
``FAMILIES`` with what its class does that a config does not say (the defaults of its config class, its norm,
its block layout). Everything else a config may switch on is either read into a field or refused in one line.

Note: [no silent proxy] a config read into the wrong shape gives figures for a model the user does not train.
Every row here is held to transformers' own class by ``tests/test_analytic_zoo.py`` (parameters exactly,
saved bytes per layer against the trace); a ``model_type`` without a row, or a key that changes what the class
computes and has no field (latent attention, sliding-window layers in SDPA, dropout inside attention), is
refused, naming ``recompute profile`` / ``recompute trace``, which measure the real class.
"""

from __future__ import annotations

from typing import Any

from recompute.core.errors import ConfigError
from recompute.core.raw_config import check_config

__all__ = ["FAMILIES", "MEASURE_INSTEAD", "spec_fields"]

MEASURE_INSTEAD = "`recompute profile --model PATH` or `recompute trace --model PATH` measure the real class"
"""The alternative every refusal names."""

_GATED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "mixtral", "qwen3_moe"}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 4096},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": "head", "head_dim": 128},
    "phi3": {"fused_qkv": True},
    "olmo2": {"norm": "rmsnorm_fp32", "residual": "post", "qk_norm": "full"},
    "gemma": {"norm": "gemma_rmsnorm", "head_dim": 256, "tied_embeddings": True},
    "gemma2": {
        "norm": "gemma_rmsnorm",
        "residual": "sandwich",
        "head_dim": 256,
        "tied_embeddings": True,
        "attn_softcap": 50.0,
        "eager_only": True,
    },
    "mixtral": {"n_experts": 8, "top_k": 2, "norm_topk": True, "fp32_routing": True},
    "qwen3_moe": {"qk_norm": "head", "n_experts": 128, "top_k": 8, "d_expert": 768},
    "gpt_neox": {
        "norm": "layernorm",
        "bias": True,
        "fused_qkv": True,
        "residual": "parallel",
        "rotary_fraction": 0.25,
    },
    "gpt2": {"norm": "layernorm", "bias": True, "position": "learned", "tied_embeddings": True, "fused_qkv": True},
}
"""What each covered ``model_type``'s class does (and its config class's defaults for keys a config may omit)."""

_ACTIVATION = {"gpt_neox": "gelu", "gpt2": "gelu_new", "gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh"}
"""The config classes' default activation where it is not silu."""

_MULTI_HEAD = {"gpt_neox", "gpt2"}
"""Families whose class has no grouped-query attention (a ``num_key_value_heads`` key is ignored)."""

_KV_HEADS_STATED = {"mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen3_moe"}
"""Families whose config class defaults ``num_key_value_heads`` to a fixed number: a config must state it."""

_NOT_MODELLED = {
    "kv_lora_rank": "low-rank latent attention",
    "q_lora_rank": "low-rank latent attention",
    "n_routed_experts": "DeepSeek-style routed experts",
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "first_k_dense_replace": "dense-first layers",
    "output_router_logits": "the router auxiliary loss",
    "router_jitter_noise": "router jitter",
    "final_logit_softcapping": None,  # outside the layers: the per-layer figures do not change
    "use_sliding_window": "sliding-window layers",
    "attention_dropout": "dropout inside attention",
    "hidden_dropout": "residual dropout",
    "attention_bias": "attention biases",
    "mlp_bias": "MLP biases",
    "rope_scaling": None,  # changes the rotary frequencies, not any tensor's size
    "alibi": "ALiBi attention biases",
}
"""Config keys whose feature has no field, and what it is (``None``: read or harmless). A key counts only when
it is switched on (truthy) and differs from what the family's class does anyway."""

_EXPERT_KEYS = ("num_local_experts", "num_experts", "moe_intermediate_size", "num_experts_per_tok")

_FEATURES: dict[str, str] = {
    **{key: what for key, what in _NOT_MODELLED.items() if what},
    **dict.fromkeys(("num_local_experts", "num_experts", "moe_num_experts"), "mixture-of-experts layers"),
    **dict.fromkeys(("mlp_only_layers", "moe_layer_freq"), "dense layers among the MoE layers"),
    **dict.fromkeys(("moe_num_shared_experts", "num_shared_experts"), "shared experts"),
    **dict.fromkeys(("index_topk", "index_n_heads"), "a sparse-attention indexer"),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "mamba_n_heads"), "state-space (Mamba) layers"),
    **dict.fromkeys(("linear_num_key_heads", "linear_conv_kernel_dim"), "linear-attention layers"),
    **dict.fromkeys(("no_rope_layers", "no_rope_layer_interval"), "layers without rotary embeddings"),
    "sliding_window_pattern": "sliding-window layers",
    "attn_logit_softcapping": "attention logit soft-capping",
    "parallel_attn": "attention and MLP in parallel",
    "multi_query": "multi-query attention",
    "new_decoder_architecture": "Falcon's new decoder layout",
}
"""What a config of a ``model_type`` without a row switches on, named in its refusal (what the analytic model
would have to model; ``--analytic`` says which, not only the type)."""

_LAYER_TYPES = {
    "sliding_attention": "sliding-window layers",
    "linear_attention": "linear-attention layers",
    "chunked_attention": "chunked-attention layers",
}
"""``layer_types`` entries other than full attention, in words."""

_FAMILY_ALLOWS = {"gpt_neox": {"attention_bias"}}
"""Keys of ``_NOT_MODELLED`` a family's fields cover (GPT-NeoX: biases everywhere, ``bias``)."""


def _first(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def _refuse(kind: str, what: str) -> ConfigError:
    return ConfigError(
        f"model_type {kind!r} with {what} is not modelled by recompute's analytic model; refusing rather than "
        f"guessing a dense shape: {MEASURE_INSTEAD}"
    )


def check_covered(raw: dict[str, Any]) -> str:
    """The config's ``model_type`` when the analytic model covers it; otherwise a one-line ConfigError.

    Raises:
        ConfigError: not a decoder-only LM, no or an unknown ``model_type``, or a feature without a field.
    """
    kind = raw.get("model_type")
    if raw.get("is_encoder_decoder") or "text_config" in raw or "vision_config" in raw or "encoder" in raw:
        raise ConfigError(
            f"{kind or 'this config'} is not a decoder-only language model (encoder-decoder or multimodal); "
            "recompute models decoder-only causal LMs"
        )
    if kind is None:
        raise ConfigError("the config has no model_type; pass a transformers config.json of a decoder-only causal LM")
    if kind not in FAMILIES:
        types = set(raw.get("layer_types") or ()) - {"full_attention"}
        kinds = {_LAYER_TYPES.get(t, f"{t} layers") for t in types}
        features = sorted({what for key, what in _FEATURES.items() if raw.get(key)} | kinds)
        has = f" (its config has {_listed(features)}, which no formula here models)" if features else ""
        raise ConfigError(
            f"model_type {kind!r} is not modelled by recompute's analytic model{has}; it covers "
            f"{', '.join(FAMILIES)}; refusing rather than estimating it as another architecture: {MEASURE_INSTEAD}"
        )
    allowed = _FAMILY_ALLOWS.get(kind, set())
    beyond = sorted(
        {what for key, what in _NOT_MODELLED.items() if what and raw.get(key) and key not in allowed}
        | _pattern_problems(kind, raw)
    )
    if beyond:
        raise _refuse(kind, _listed(beyond))
    return str(kind)


def _listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _pattern_problems(kind: str, raw: dict[str, Any]) -> set[str]:
    """Layer patterns the fields cannot express."""
    problems = set()
    types = set(raw.get("layer_types") or ())
    if types - {"full_attention"} and kind != "gemma2":  # Gemma 2 runs eager attention: a window saves the same
        problems.add("sliding-window layers")
    if not FAMILIES[kind].get("n_experts") and any(raw.get(k) for k in _EXPERT_KEYS):
        problems.add("mixture-of-experts layers")  # the class would ignore them: the config means another model
    return problems


def spec_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` keyword arguments for a covered config (``check_covered`` first)."""
    kind = check_covered(raw)
    check_config(raw, kind)
    fam = FAMILIES[kind]
    hidden = _first(raw, "hidden_size", "n_embd")
    layers = _first(raw, "num_hidden_layers", "n_layer")
    heads = _first(raw, "num_attention_heads", "n_head")
    if hidden is None or layers is None or heads is None:
        raise ConfigError(
            f"the {kind} config lacks hidden_size/n_embd, num_hidden_layers/n_layer or num_attention_heads/n_head; "
            "pass the model's full config.json"
        )
    if kind in _KV_HEADS_STATED and raw.get("num_key_value_heads") is None:
        raise ConfigError(f"the {kind} config lacks num_key_value_heads (its class has a fixed default); state it")
    out: dict[str, Any] = {k: v for k, v in fam.items() if k != "rotary_fraction"}
    out.update(
        hidden=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=0 if kind in _MULTI_HEAD else _first(raw, "num_key_value_heads", default=0),
        head_dim=_first(raw, "head_dim", default=fam.get("head_dim", 0)),
        vocab=_first(raw, "vocab_size", default=50257),
        max_positions=_first(raw, "max_position_embeddings", "n_positions", "n_ctx", default=2048),
        norm_eps=float(_first(raw, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", default=1e-5)),
        tied_embeddings=bool(_first(raw, "tie_word_embeddings", default=fam.get("tied_embeddings", False))),
        position=fam.get("position", "rotary"),
        norm=fam.get("norm", "rmsnorm"),
        dropout=0.0,
        bias=fam.get("bias", False),
        kv_cache=bool(raw.get("use_cache", True)),
    )
    out.update(_mlp_fields(kind, raw))
    out.update(_rotary_fields(kind, raw, out))
    out.update(_family_fields(kind, raw))
    return out


def _mlp_fields(kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    act = str(
        _first(raw, "hidden_activation", "hidden_act", "activation_function", default=_ACTIVATION.get(kind, "silu"))
    )
    gated = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu": "geglu"}
    plain = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu_new"}
    table = gated if kind in _GATED else plain
    if act not in table:
        raise _refuse(kind, f"the activation {act!r}")
    d_ff = _first(raw, "intermediate_size", "n_inner", default=0)
    if kind in _GATED and not d_ff:
        raise ConfigError(f"the {kind} config lacks intermediate_size; pass the model's full config.json")
    return {"mlp": table[act], "d_ff": d_ff}


def _rotary_fields(kind: str, raw: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    if out["position"] != "rotary":
        return {}
    rope = raw.get("rope_parameters") or {}
    theta = _first(raw, "rope_theta", default=rope.get("rope_theta", 10000.0))
    fraction = _first(raw, "rotary_pct", "partial_rotary_factor", default=None)
    if fraction is None:
        fraction = rope.get("partial_rotary_factor", FAMILIES[kind].get("rotary_fraction", 1.0))
    head_dim = out["head_dim"] or out["hidden"] // out["n_heads"]
    return {"rope_theta": float(theta), "rotary_dim": int(head_dim * float(fraction))}


def _family_fields(kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    fam = FAMILIES[kind]
    out: dict[str, Any] = {}
    if kind == "gpt2":
        out["dropout"] = max(float(raw.get(k, 0.1) or 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop"))
    if kind == "gpt_neox":
        out["residual"] = "parallel" if raw.get("use_parallel_residual", True) else "pre"
    if kind == "gemma2":
        out["attn_softcap"] = float(_first(raw, "attn_logit_softcapping", default=fam["attn_softcap"]) or 0.0)
    if kind == "mistral":
        out["sliding_window"] = int(_first(raw, "sliding_window", default=0) or 0)
    if fam.get("n_experts"):
        out.update(_moe_fields(kind, raw))
    return out


def _moe_fields(kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    fam = FAMILIES[kind]
    experts = int(_first(raw, "num_local_experts", "num_experts", default=fam["n_experts"]))
    if kind == "mixtral":
        return {"n_experts": experts, "top_k": int(_first(raw, "num_experts_per_tok", default=2)), "d_expert": 0}
    step = int(raw.get("decoder_sparse_step") or 1)
    layers = int(_first(raw, "num_hidden_layers", default=0))
    only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step != 0)
    return {
        "n_experts": experts,
        "top_k": int(_first(raw, "num_experts_per_tok", default=fam["top_k"])),
        "d_expert": int(_first(raw, "moe_intermediate_size", default=fam["d_expert"])),
        "norm_topk": bool(raw.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }

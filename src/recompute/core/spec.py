"""``ModelSpec``: the shape of a decoder-only transformer, declared once.

Everything recompute computes about a model (parameters, activation bytes, FLOPs) and every model it builds
comes from this one dataclass. Derived fields are filled in and checked in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from recompute.core.errors import ConfigError, one_of, positive_int, require
from recompute.core.presets import PRESETS
from recompute.core.results import read_json

__all__ = ["ModelSpec", "hf_config_dict", "resolve_model"]

MLPKind = Literal["gelu", "swiglu"]
NormKind = Literal["layernorm", "rmsnorm"]
PositionKind = Literal["learned", "rotary"]


SIZE_LIMITS = {"hidden": 2**20, "n_layers": 2**14, "n_heads": 2**16, "vocab": 2**24, "max_positions": 2**24}
"""The largest value each size takes: far beyond any model (larger is a typo that would hang the work)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Defaults describe GPT-2 small; presets list only what differs.

    Example:
        >>> ModelSpec.from_name("llama3.1-8b").n_kv_heads
        8
    """

    hidden: int = 768
    """h: width of the residual stream."""
    n_layers: int = 12
    """L: number of transformer layers."""
    n_heads: int = 12
    """a: attention (query) heads."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 (the default) means ``n_heads`` (multi-head attention)."""
    head_dim: int = 0
    """Width of one head; 0 (the default) means ``hidden // n_heads``."""
    d_ff: int = 0
    """MLP inner width; 0 (the default) means 4h for GELU and Llama's rule (8h/3 rounded up to 256) for SwiGLU."""
    vocab: int = 50257
    """v: vocabulary size."""
    mlp: MLPKind = "gelu"
    """``gelu`` (two matmuls, GPT) or ``swiglu`` (gate, up and down matmuls, Llama)."""
    norm: NormKind = "layernorm"
    """``layernorm`` (GPT) or ``rmsnorm`` (Llama)."""
    position: PositionKind = "learned"
    """``learned`` position embeddings (GPT) or ``rotary`` (Llama)."""
    dropout: float = 0.1
    """Dropout probability on embeddings, attention probabilities and both residual branches; 0 stores no masks."""
    tied_embeddings: bool = True
    """Whether the output layer shares the token-embedding matrix."""
    bias: bool = True
    """Whether linear layers and LayerNorms carry biases."""
    max_positions: int = 1024
    """Longest sequence the model takes (the size of the learned position table, or the rotary context)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies (rotary models only)."""
    name: str = "custom"
    """Preset name, or ``custom``."""
    source: str = field(default="", compare=False)
    """Where the figures come from."""

    def __post_init__(self) -> None:
        for name in ("hidden", "n_layers", "n_heads", "vocab", "max_positions"):
            positive_int(name, getattr(self, name), at_most=SIZE_LIMITS[name])
        one_of("mlp", self.mlp, ("gelu", "swiglu"))
        one_of("norm", self.norm, ("layernorm", "rmsnorm"))
        one_of("position", self.position, ("learned", "rotary"))
        require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.head_dim == 0:
            require(
                self.hidden % self.n_heads == 0,
                f"n_heads ({self.n_heads}) must divide hidden ({self.hidden}); pick a head count that divides it "
                "or set head_dim explicitly",
            )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        positive_int("head_dim", self.head_dim, at_most=2**16)
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        positive_int("n_kv_heads", self.n_kv_heads)
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}) for grouped-query attention",
        )
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.hidden if self.mlp == "gelu" else _llama_ffn(self.hidden))
        positive_int("d_ff", self.d_ff, at_most=2**24)

    @property
    def q_dim(self) -> int:
        """Width of the query projection, a * head_dim (= h for standard attention)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections, n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-ready values."""
        return dataclasses.asdict(self)

    def resized(self, **sizes: int | float | None) -> ModelSpec:
        """This architecture at another size; ``None`` values are ignored.

        A new ``hidden`` re-derives ``d_ff`` (the old width's MLP belongs to the old width); a new ``hidden``
        or ``n_heads`` re-derives ``head_dim``; grouped-query attention is kept where the new head count
        allows it (``n_kv_heads`` divides it), multi-head attention stays multi-head.

        Example:
            >>> ModelSpec.from_name("llama3.1-8b").resized(n_layers=2, hidden=256, n_heads=8).n_kv_heads
            8
        """
        given: dict[str, Any] = {k: v for k, v in sizes.items() if v is not None}
        if "hidden" in given and "d_ff" not in given:
            given["d_ff"] = 0
        if ("hidden" in given or "n_heads" in given) and "head_dim" not in given:
            given["head_dim"] = 0
        heads = given.get("n_heads", self.n_heads)
        if "n_kv_heads" not in given and (self.n_kv_heads == self.n_heads or heads % self.n_kv_heads):
            given["n_kv_heads"] = 0
        return dataclasses.replace(self, **given)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelSpec:
        """Build a preset by name, optionally overriding fields.

        Raises:
            ConfigError: the name is not a preset; the message lists the presets.
        """
        if name not in PRESETS:
            raise ConfigError(f"{name!r} is not a known model; known models: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], "name": name, **overrides})

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> ModelSpec:
        """Build a spec from a Hugging Face config object, a config dict, or a config.json path (no network).

        Reads GPT-2 style keys (``n_embd``, ``n_layer``, ...) and Llama style keys (``hidden_size``,
        ``num_hidden_layers``, ``num_key_value_heads``, ...), so other decoder-only configs that use either
        naming work too.
        """
        raw = hf_config_dict(config)
        _check_modelled(raw)
        return cls(
            **_from_hf_dict(raw),
            name=name or str(raw.get("_name_or_path") or raw.get("model_type") or "hf"),
            source=f"{HF_SOURCE} ({raw.get('model_type')})",
        )


def resolve_model(name: str) -> ModelSpec:
    """A preset by name.

    Raises:
        ConfigError: an unknown name, or the path of a transformers config: no formula here is held to
            transformers' own classes (``recompute trace`` builds and measures them), so none is given.
    """
    if name in PRESETS:
        return ModelSpec.from_name(name)
    path = Path(name)
    if path.exists():
        ModelSpec.from_hf_config(path)  # an unreadable or unmodelled config gets its own one-line refusal first
        raise ConfigError(
            f"{name!r} is a transformers config: the closed-form model describes recompute's reference GPT-2 and "
            "Llama, and transformers' own class keeps other tensors (several times more for a GPT-2 config); drop "
            f"--analytic to use the class's measured profile (recompute profile --model {name}; trace, verify, bench "
            "and train build the class too)"
        )
    raise ConfigError(f"{name!r} is not a known model or a config.json path; known models: {', '.join(PRESETS)}")


def _llama_ffn(h: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width rule: 2/3 of 4h, rounded up to a multiple (meta-llama/llama model.py)."""
    hidden = int(2 * 4 * h / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A transformers config as a dict: from a dict, a config object, or a config.json path (or its folder)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        return read_json(path, "model config", "pass a transformers config.json of a decoder-only causal LM")
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise ConfigError(f"expected a transformers config, a dict or a config.json path; got {type(config).__name__}")


HF_SOURCE = "a transformers config"
"""How ``from_hf_config`` marks ``ModelSpec.source``."""

MODELLED_TYPES = ("llama", "gpt2")
"""The transformers ``model_type``s a ``ModelSpec`` describes exactly (tests hold it to their classes)."""

_BEYOND_THE_SPEC = {
    "num_local_experts": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
    "n_routed_experts": "mixture-of-experts layers",
    "moe_intermediate_size": "mixture-of-experts layers",
    "kv_lora_rank": "low-rank latent attention",
    "q_lora_rank": "low-rank latent attention",
}
"""Config keys whose feature the spec has no field for, and what the feature is."""


def _check_modelled(raw: dict[str, Any]) -> None:
    """Refuse, in one line, a config whose architecture a ``ModelSpec`` would describe only approximately.

    Note: [no silent proxy] a config of another architecture (MoE, gated GELU, extra q/k norms, fused
    projections, ...) read into a dense Llama or GPT-2 shape gives figures for a model the user does not
    train. recompute models what it holds to the real class and refuses the rest.
    """
    kind = raw.get("model_type")
    if raw.get("is_encoder_decoder") or "text_config" in raw or "vision_config" in raw or "encoder" in raw:
        raise ConfigError(
            f"{kind or 'this config'} is not a decoder-only language model (encoder-decoder or multimodal); "
            "recompute models decoder-only causal LMs"
        )
    if kind is None:
        raise ConfigError("the config has no model_type; pass a transformers config.json of a decoder-only causal LM")
    beyond = sorted({what for key, what in _BEYOND_THE_SPEC.items() if raw.get(key)})
    if kind not in MODELLED_TYPES or beyond:
        extra = f" ({', '.join(beyond)})" if beyond else ""
        raise ConfigError(
            f"model_type {kind!r}{extra} is not modelled exactly by recompute's analytic model, which covers "
            f"{', '.join(MODELLED_TYPES)}; refusing rather than estimating it as a dense Llama or GPT-2"
        )


def _first(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def _from_hf_dict(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = _first(raw, "hidden_size", "n_embd", "d_model")
    layers = _first(raw, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(raw, "num_attention_heads", "n_head")
    if hidden is None or layers is None or heads is None:
        raise ConfigError(
            "HF config lacks hidden_size/n_embd, num_hidden_layers/n_layer or num_attention_heads/n_head; "
            "is it a decoder-only transformer config?"
        )
    act = str(_first(raw, "hidden_act", "activation_function", default="gelu"))
    gated = act in ("silu", "swish") or raw.get("model_type") in ("llama", "mistral", "qwen2", "qwen3")
    learned = raw.get("model_type") in ("gpt2", "gpt_neo", "opt", "gpt_bigcode") or "n_positions" in raw
    dropout = max(
        float(_first(raw, key, default=0.0))
        for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout")
    )
    return dict(
        hidden=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=_first(raw, "num_key_value_heads", default=0),
        head_dim=_first(raw, "head_dim", default=0),
        d_ff=_first(raw, "intermediate_size", "n_inner", "ffn_dim", default=0),
        vocab=_first(raw, "vocab_size", default=50257),
        mlp="swiglu" if gated else "gelu",
        norm="layernorm" if "layer_norm_epsilon" in raw or not gated else "rmsnorm",
        position="learned" if learned else "rotary",
        dropout=dropout,
        tied_embeddings=bool(_first(raw, "tie_word_embeddings", default=True)),
        bias=bool(_first(raw, "attention_bias", "bias", default=not gated)),
        max_positions=_first(raw, "max_position_embeddings", "n_positions", "n_ctx", default=2048),
        norm_eps=float(_first(raw, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", default=1e-5)),
        rope_theta=float(_first(raw, "rope_theta", default=10000.0)),
    )

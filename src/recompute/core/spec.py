"""``ModelSpec``: the shape of a decoder-only transformer, declared once.

Everything recompute computes about a model (parameters, activation bytes, FLOPs) and every model it builds
comes from this one dataclass. Derived fields are filled in and checked in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from recompute.core.errors import ConfigError, one_of, positive_int, require
from recompute.core.files import is_path
from recompute.core.hf_config import spec_fields
from recompute.core.presets import PRESETS
from recompute.core.raw_config import SIZE_LIMITS
from recompute.core.results import read_json

__all__ = [
    "HF_ALIASES",
    "ModelSpec",
    "analytic_model",
    "check_model_text",
    "hf_config_dict",
    "resolve_model",
    "spec_from_config",
]

HF_ALIASES = {"llama": "llama3.1-8b"}
"""``hf:NAME`` shorthands for a preset."""
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""``package.module:factory``."""

MLPKind = Literal["gelu", "gelu_new", "swiglu", "geglu"]
NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_fp32", "gemma_rmsnorm"]
PositionKind = Literal["learned", "rotary"]
ResidualKind = Literal["pre", "post", "sandwich", "parallel"]
QKNormKind = Literal["", "head", "full"]
MLPS: tuple[str, ...] = ("gelu", "gelu_new", "swiglu", "geglu")
NORMS: tuple[str, ...] = ("layernorm", "rmsnorm", "rmsnorm_fp32", "gemma_rmsnorm")


HF_SOURCE = "a transformers config"
"""How ``from_hf_config`` marks ``ModelSpec.source``."""


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
    """``gelu`` (two matmuls, GPT; one fused GELU op), ``gelu_new`` (GPT-2's tanh GELU written out in ops, which
    saves four d_ff-wide tensors), ``swiglu`` (gate, up and down matmuls, Llama) or ``geglu`` (the same with
    a tanh GELU gate, Gemma)."""
    norm: NormKind = "layernorm"
    """``layernorm`` (GPT) or ``rmsnorm`` (Llama); for transformers' classes also ``rmsnorm_fp32`` (the weight
    applied in fp32 before the cast back, OLMo 2) and ``gemma_rmsnorm`` (the same with (1 + w), Gemma)."""
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
    residual: ResidualKind = "pre"
    """Where the norms sit: ``pre`` (x + f(norm(x)), GPT/Llama), ``post`` (x + norm(f(x)), OLMo 2), ``sandwich``
    (x + norm(f(norm(x))), Gemma 2: four norms) or ``parallel`` (x + attn(norm1(x)) + mlp(norm2(x)), GPT-NeoX)."""
    qk_norm: QKNormKind = ""
    """RMSNorm on queries and keys: ``head`` (per head over head_dim, Qwen3), ``full`` (over all of Q and of K,
    OLMo 2), or ``""`` (none)."""
    qkv_bias: bool = False
    """Biases on the Q, K and V projections only (Qwen2); ``bias`` puts them on every linear and norm."""
    fused_qkv: bool = False
    """One Q/K/V projection (Phi-3, GPT-NeoX): with rotary positions SDPA's output is then copied before the
    output projection."""
    kv_cache: bool = True
    """transformers' class builds a key/value cache in training (config ``use_cache``): K and V reach SDPA as the
    cache's copies. Without one a fused Q/K/V output stays whole behind V, a view of it (2·s·h·e more a layer
    for Phi-3 and GPT-NeoX; issue 37)."""
    rotary_dim: int = 0
    """Rotated width of each head (GPT-NeoX rotates a quarter); 0 means head_dim."""
    attn_softcap: float = 0.0
    """Soft-capping of the attention logits, c * tanh(x / c) (Gemma 2); 0: none."""
    eager_only: bool = False
    """The class refuses SDPA (Gemma 2 in transformers 5): ``flash`` runs its eager attention."""
    sliding_window: int = 0
    """Tokens each query sees (Mistral); 0: all. Shorter than the sequence, SDPA gets an explicit mask."""
    n_experts: int = 0
    """E: routed experts of each MoE layer; 0 (the default): every MLP is dense."""
    top_k: int = 0
    """k: experts each token is routed to (MoE only)."""
    d_expert: int = 0
    """Inner width of one expert; 0 means ``d_ff`` (Mixtral). Dense layers of an MoE model keep ``d_ff``."""
    dense_layers: tuple[int, ...] = ()
    """Layers of an MoE model whose MLP is dense (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``)."""
    norm_topk: bool = False
    """The router renormalises the top-k probabilities (Mixtral; Qwen3-MoE's ``norm_topk_prob``)."""
    fp32_routing: bool = False
    """The routing weights reach the experts in fp32 (Mixtral) rather than cast to the activation dtype."""
    name: str = "custom"
    """Preset name, or ``custom``."""
    source: str = field(default="", compare=False)
    """Where the figures come from."""

    def __post_init__(self) -> None:
        for name in ("hidden", "n_layers", "n_heads", "vocab", "max_positions"):
            positive_int(name, getattr(self, name), at_most=SIZE_LIMITS[name])
        one_of("mlp", self.mlp, MLPS)
        one_of("norm", self.norm, NORMS)
        one_of("position", self.position, ("learned", "rotary"))
        one_of("residual", self.residual, ("pre", "post", "sandwich", "parallel"))
        one_of("qk_norm", self.qk_norm, ("", "head", "full"))
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
            object.__setattr__(
                self, "d_ff", 4 * self.hidden if self.mlp in ("gelu", "gelu_new") else _llama_ffn(self.hidden)
            )
        positive_int("d_ff", self.d_ff, at_most=2**24)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        self._check_experts()

    def _check_experts(self) -> None:
        if self.n_experts == 0:
            require(self.top_k == 0 and not self.dense_layers, "top_k and dense_layers need n_experts > 0")
            return
        positive_int("n_experts", self.n_experts, at_most=2**16)
        require(
            1 <= self.top_k <= self.n_experts,
            f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})",
            fields=("top_k",),
        )
        if self.d_expert == 0:
            object.__setattr__(self, "d_expert", self.d_ff)
        positive_int("d_expert", self.d_expert, at_most=2**24)
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        require(
            all(0 <= i < self.n_layers for i in self.dense_layers),
            f"dense_layers must be layer indices below {self.n_layers}",
            fields=("dense_layers",),
        )

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (three matmuls: SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def transformers(self) -> bool:
        """Whether this spec describes transformers' own class (read from a config), not recompute's models."""
        return self.source.startswith(HF_SOURCE)

    @property
    def reference(self) -> bool:
        """Whether recompute's reference GPT/Llama can build this spec (no transformers-only feature)."""
        return (
            self.mlp in ("gelu", "swiglu")
            and self.norm in ("layernorm", "rmsnorm")
            and (self.residual, self.qk_norm, self.n_experts, self.sliding_window) == ("pre", "", 0, 0)
            and not (self.qkv_bias or self.fused_qkv or self.attn_softcap or self.eager_only)
            and self.rotary_dim == self.head_dim
        )

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` routes its tokens to experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

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
        if "head_dim" in given and "rotary_dim" not in given:  # keep the rotated fraction of each head
            heads = given.get("n_heads", self.n_heads)
            width = given["head_dim"] or (given.get("hidden", self.hidden) // heads if heads else 0)
            given["rotary_dim"] = self.rotary_dim * width // self.head_dim
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
        """The spec of transformers' class for a config object, a config dict, or a config.json path (no network).

        Reads the architectures in ``recompute.core.hf_config.FAMILIES`` (dense and MoE); anything else is
        refused in one line that names ``recompute profile`` / ``recompute trace``.

        Raises:
            ConfigError: unreadable, not covered, or a feature the analytic model does not model.
        """
        raw = hf_config_dict(config)
        return cls(
            **spec_fields(raw),
            name=name or str(raw.get("_name_or_path") or raw.get("model_type") or "hf"),
            source=f"{HF_SOURCE} ({raw.get('model_type')})",
        )


def spec_from_config(config: Any, *, name: str | None = None) -> ModelSpec:
    """``ModelSpec.from_hf_config``: the analytic model's spec of a transformers config (``--analytic``).

    Example:
        >>> spec_from_config({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        ...     "vocab_size": 128}).n_experts
        8
    """
    return ModelSpec.from_hf_config(config, name=name)


def analytic_model(name: str) -> ModelSpec:
    """``--analytic``: a preset, or the spec of a config.json the closed-form model covers (``spec_from_config``).

    Raises:
        ConfigError: an unknown name, or a config with a feature the closed form does not model (the message
            names ``recompute profile``, which measures the real class).
    """
    return spec_from_config(name, name=Path(name).stem) if is_path(name) else resolve_model(name)


def resolve_model(name: str) -> ModelSpec:
    """A preset by name.

    Raises:
        ConfigError: an unknown name, or the path of a transformers config: no formula here is held to
            transformers' own classes (``recompute trace`` builds and measures them), so none is given.
    """
    if name in PRESETS:
        return ModelSpec.from_name(name)
    path = Path(name)
    if is_path(name):
        ModelSpec.from_hf_config(path)  # an unreadable or unmodelled config gets its own one-line refusal first
        raise ConfigError(
            f"{name!r} is a transformers config: this command's formulas are held to presets; estimate and plan "
            f"take it (its measured profile: recompute profile --model {name}, or --analytic), and trace, verify, "
            "bench and train build its class"
        )
    raise ConfigError(f"{name!r} is not a known model or a config.json path; known models: {', '.join(PRESETS)}")


def _llama_ffn(h: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width rule: 2/3 of 4h, rounded up to a multiple (meta-llama/llama model.py)."""
    hidden = int(2 * 4 * h / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def check_model_text(text: str) -> str:
    """``text`` when it has one of ``--model``'s forms (a preset, ``hf:`` and a preset, an existing path, or
    ``package.module:factory``), checked without torch: a mistyped name is refused at once, not after the seconds
    ``import torch`` takes.

    Raises:
        ConfigError: none of these (the message lists the forms and the known models).
    """
    base = text.removeprefix("hf:")
    if base in PRESETS or (text.startswith("hf:") and base in HF_ALIASES) or is_path(text) or is_factory(text):
        return text
    raise ConfigError(
        f"{text!r} is not a known model, an existing config.json path or a package.module:factory; "
        f"known models: {', '.join(PRESETS)}"
    )


def is_factory(text: str) -> bool:
    """Whether ``text`` reads as ``package.module:factory``."""
    return _FACTORY.match(text) is not None


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

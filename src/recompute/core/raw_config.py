"""Checks of a transformers config.json's raw fields, before anything is built from it. Torch-free.

A config must state its sizes (a transformers default would invent a model), each a whole number within
``SIZE_LIMITS`` (a config with 10^6 layers kept building for minutes; ``"hidden_size": "4096"``, a string, was a
TypeError in the analytic model's arithmetic), and their shapes must agree. Both the analytic model
(``recompute.core.hf_config``) and the builder of transformers' own class (``recompute.models.source``) check
a config here first.
"""

from __future__ import annotations

from typing import Any

from recompute.core.errors import ConfigError

__all__ = ["SIZE_LIMITS", "check_config"]

SIZE_LIMITS = {"hidden": 2**20, "n_layers": 2**14, "n_heads": 2**16, "vocab": 2**24, "max_positions": 2**24}
"""The largest value each size field takes (far beyond any real model: larger means a typo, e.g. 1e30)."""

_REQUIRED = {
    "hidden size": ("hidden_size", "n_embd", "d_model", "dim"),
    "layer count": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "head count": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "vocabulary": ("vocab_size",),
}
"""Fields a config.json must state (one key of each row); a transformers default would invent a model."""
_SIZES = {
    **_REQUIRED,
    "positions": ("max_position_embeddings", "n_positions", "n_ctx"),
    "MLP width": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "key/value heads": ("num_key_value_heads",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "head width": ("head_dim",),
}
"""Sizes ``check_config`` holds to ``SIZE_LIMITS`` where a config states them."""
_LIMIT_OF = {"hidden size": "hidden", "layer count": "n_layers", "head count": "n_heads", "vocabulary": "vocab"}
_LIMIT_OF |= {"positions": "max_positions", "key/value heads": "n_heads"}
_OTHER_LIMIT = 2**24
"""The limit of a size ``SIZE_LIMITS`` has no row for (an MLP width, an expert count)."""


def check_config(raw: dict[str, Any], kind: object) -> None:
    """Refuse a config that lacks a required size, states one that is not a positive integer within its limit, or
    whose heads do not fit its width.

    Raises:
        ConfigError: the first problem, naming the field and the fix.
    """
    missing = [what for what, keys in _REQUIRED.items() if not any(raw.get(k) for k in keys)]
    if missing:
        raise ConfigError(
            f"the {kind} config lacks its {', '.join(missing)} "
            f"({' / '.join(k for w in missing for k in _REQUIRED[w])}); pass the model's full config.json"
        )
    _check_sizes(raw, kind)


def _check_sizes(raw: dict[str, Any], kind: object) -> None:
    """Refuse, before transformers builds anything, a size that is not a positive integer or is beyond
    ``SIZE_LIMITS`` (a config with 10^6 layers kept building for minutes, 2.8 GiB and growing).

    Raises:
        ConfigError: the first such field, with its limit.
    """
    for what, keys in _SIZES.items():
        for key in keys:
            value = raw.get(key)
            if value is None:  # not stated (a required row has another key stated: checked before)
                continue
            limit = SIZE_LIMITS.get(_LIMIT_OF.get(what, ""), _OTHER_LIMIT)
            per_layer = what == "MLP width" and isinstance(value, list) and value  # Gemma 3n's MLP width per layer
            if not all(_whole(v, limit) for v in (value if per_layer else [value])):
                each = " (or a list of them, one per layer)" if what == "MLP width" else ""
                raise ConfigError(
                    f"the {kind} config's {key} must be a whole number from 1 to {limit:,}{each}, got "
                    f"{_shown(value)}; fix the config.json"
                )
    hidden, heads = (next((k, raw[k]) for k in _REQUIRED[w] if raw.get(k)) for w in ("hidden size", "head count"))
    latent = raw.get("kv_lora_rank") is not None or raw.get("qk_nope_head_dim") is not None  # heads sized apart
    if raw.get("head_dim") is None and not latent and hidden[1] % heads[1]:
        raise ConfigError(
            f"the {kind} config's {heads[0]} ({heads[1]}) does not divide its {hidden[0]} ({hidden[1]}) and it "
            "states no head_dim; fix the config.json"
        )
    kv = raw.get("num_key_value_heads")
    if kv is not None and heads[1] % kv:  # the attention's shapes fail mid-trace (a traceback)
        raise ConfigError(
            f"the {kind} config's num_key_value_heads ({kv}) does not divide its {heads[0]} ({heads[1]}); "
            "fix the config.json"
        )
    experts = next((raw[k] for k in _SIZES["experts"] if raw.get(k) is not None), None)
    top_k = raw.get("num_experts_per_tok")
    ok = isinstance(top_k, int) and not isinstance(top_k, bool) and 0 < top_k <= (experts or 0)
    if experts is not None and top_k is not None and not ok:  # topk failed mid-trace ("k not in range")
        raise ConfigError(
            f"the {kind} config's num_experts_per_tok must be a whole number from 1 to its {experts} experts, "
            f"got {top_k!r}; fix the config.json"
        )


def _whole(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit


def _shown(value: Any) -> str:
    """``value`` as the message shows it: a long list cut to its first items."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

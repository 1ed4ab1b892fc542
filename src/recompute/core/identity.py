"""``ModelId``: which model a plan or a profile is about, as a hash of what determines its shapes. Torch-free.

A plan is made for one model and applies to that model however it is built: from its config.json, the folder
holding it, ``from_pretrained``, a config naming a hub repository, or a factory. So a plan names the model by
a hash of its architecture, with a readable name beside it for messages; the name is never compared when
both sides have a hash. Three kinds of model, three things hashed:

- a preset (``ModelSpec``): its shape fields (``spec_id``); not its name, source or the numerics that change
  no tensor (the norm's epsilon, the rotary base); ``kv_cache`` where it is off;
- a transformers config: its architecture fields (``config_id``), i.e. its full ``to_dict()`` without what
  names, types or runs it (``NOT_ARCHITECTURE``: its path, class list, dtype, library version, attention
  implementation, output switches, token ids, labels, initialisation), and ``use_cache`` where it is off
  (Note: [the key/value cache changes a step]). The dict must be the
  config's full one, as transformers fills it in: a config.json as read lacks the defaults its class adds,
  so ``recompute.models.identity`` reads it through transformers first;
- any other module (a factory's): its parameters' names and shapes and its modules' classes (``module_id``).

The torch floor (``recompute.models.identity``) says which applies to a built model: recompute's models carry
their spec, transformers' their config, anything else is hashed as a module.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from recompute.core.errors import ConfigError
from recompute.core.presets import PRESETS
from recompute.core.spec import ModelSpec

__all__ = [
    "NOT_ARCHITECTURE",
    "ModelId",
    "architecture",
    "config_id",
    "module_id",
    "require_same_model",
    "spec_id",
]

NOT_ARCHITECTURE = frozenset(
    {
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "attn_implementation",
        "use_cache",  # hashed where it is off: ``_cache_off``
        "return_dict",
        "use_return_dict",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "initializer_range",
        "initializer_factor",
        # generation settings (transformers 5 keeps them in generation_config.json; older config.json files hold them)
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)
"""Config keys that neither shape a tensor nor change what a training step computes. Also left out: keys
starting with ``_`` (``_name_or_path``, ``_attn_implementation``, ...), ``output_*`` switches and token ids
(``*_token_id``, ``*_token_ids``)."""

_NOT_A_SHAPE = ("name", "source", "norm_eps", "rope_theta", "kv_cache")
"""``ModelSpec`` fields that shape no tensor; ``kv_cache`` is hashed where it is off (``_cache_off``).

Note: [the key/value cache changes a step] transformers' classes build a key/value cache in a training step
when ``use_cache`` is on, and K and V reach attention as the cache's copies; with it off, a fused Q/K/V output
stays whole behind V, a view of it: Phi-3 and GPT-NeoX keep 2·s·h·e more a layer (issue 37; the trace of every
class the sweep finds exact, docs/validation.md). A plan or profile made for one is wrong for the other, so the
identity tells them apart. Only ``off`` is hashed: a model with the cache on (every config's default) keeps
the hash it had before, and plans written then still apply."""

_SQUASH = re.compile(r"[^a-z0-9]")


@dataclass(frozen=True)
class ModelId:
    """A model as a plan or profile names it: a readable name and the hash of its architecture.

    Example:
        >>> ModelId("qwen05", "3f2a9c1b00d4e5f6").describe()
        "'qwen05' (3f2a9c1b)"
    """

    name: str
    """How messages name it: the preset, the config's folder or hub name, ``module:factory``."""
    hash: str = ""
    """16 hex digits of SHA-256 over the architecture (``spec_id``, ``config_id``, ``module_id``); empty for a
    plan file written before plans carried one (only the name is known)."""

    @property
    def short(self) -> str:
        """The hash's first 8 digits, as messages show it."""
        return self.hash[:8]

    def describe(self) -> str:
        """``'name' (3f2a9c1b)``, or ``'name'`` without a hash."""
        return f"{self.name!r} ({self.short})" if self.hash else repr(self.name)

    def same_model(self, other: ModelId) -> bool:
        """Whether both name one architecture: equal hashes; names compared loosely where a hash is missing
        (``meta-llama/Llama-3.1-8B`` = ``llama3.1-8b``)."""
        if self.hash and other.hash:
            return self.hash == other.hash
        return _squash(self.name) == _squash(other.name)

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "hash": self.hash}

    @classmethod
    def from_json(cls, value: object) -> ModelId:
        """From a plan file's ``model``: ``{"name": ..., "hash": ...}``, or a name alone (older files).

        Raises:
            ConfigError: neither.
        """
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping) and isinstance(value.get("name"), str) and isinstance(value.get("hash", ""), str):
            return cls(value["name"], value.get("hash", ""))
        raise ConfigError(f"a plan's model is a name or {{'name': ..., 'hash': ...}}, got {value!r}")


def require_same_model(planned: ModelId, found: ModelId) -> None:
    """Refuse a plan made for another model, in one line naming both.

    Raises:
        ConfigError: ``planned`` and ``found`` are not one architecture (``ModelId.same_model``).
    """
    if not planned.same_model(found):
        shown = found.describe() if planned.hash else repr(found.name)
        raise ConfigError(
            f"the plan was made for {planned.describe()} but this model is {shown}; make a plan for this model "
            "(recompute plan --model ...)"
        )


def spec_id(spec: ModelSpec, name: str | None = None) -> ModelId:
    """A preset's identity from its spec: the fields that shape its tensors.

    Named by the preset, with what differs from it when resized (``gpt2 with n_layers=4, vocab=256``), so
    that a refusal says why two models named alike are not one.
    """
    shape = _shape(spec)
    readable = name or spec.name
    if name is None and spec.name in PRESETS:
        preset = _shape(ModelSpec.from_name(spec.name))
        changed = [f"{k}={v}" for k, v in shape.items() if preset.get(k) != v]
        if changed:
            shown = ", ".join(changed[:4]) + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")
            readable = f"{spec.name} with {shown}"
    return ModelId(readable, _digest("spec", shape))


def _shape(spec: ModelSpec) -> dict[str, Any]:
    return {k: v for k, v in spec.to_dict().items() if k not in _NOT_A_SHAPE} | _cache_off(spec.kv_cache)


def _cache_off(on: object) -> dict[str, bool]:
    """``{"kv_cache": False}`` for a model run without a key/value cache, else nothing (Note: [the key/value
    cache changes a step])."""
    return {"kv_cache": False} if on is False else {}


def architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture fields of a transformers config's full dict (``to_dict()``), nested configs included."""
    return {k: _architecture_value(v) for k, v in config.items() if _is_architecture(k)}


def config_id(config: Mapping[str, Any], name: str | None = None) -> ModelId:
    """A transformers model's identity from its config's full dict (``PretrainedConfig.to_dict``).

    Args:
        name: the readable name (default: ``_name_or_path``, else ``model_type``).
    """
    readable = name or str(config.get("_name_or_path") or config.get("model_type") or "transformers model")
    return ModelId(readable, _digest("config", architecture(config) | _cache_off(config.get("use_cache"))))


def module_id(
    parameters: Iterable[tuple[str, Iterable[int]]], classes: Iterable[tuple[str, str]], name: str
) -> ModelId:
    """Any module's identity: its parameters' ``(name, shape)`` and its modules' ``(name, class)`` in order."""
    data = {
        "parameters": [[n, [int(d) for d in shape]] for n, shape in parameters],
        "modules": [[n, c] for n, c in classes],
    }
    return ModelId(name, _digest("module", data))


def _is_architecture(key: str) -> bool:
    return not (
        key in NOT_ARCHITECTURE or key.startswith(("_", "output_")) or key.endswith(("_token_id", "_token_ids"))
    )


def _architecture_value(value: Any) -> Any:
    return architecture(value) if isinstance(value, Mapping) and "model_type" in value else value


def _digest(kind: str, data: Any) -> str:
    blob = json.dumps({"kind": kind, "data": data}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _squash(name: str) -> str:
    return _SQUASH.sub("", name.rsplit("/", 1)[-1].lower())

"""Which model this is, for plans and profiles: ``recompute.core.identity`` for built models and model sources.

A built model is named by what determines its shapes (``model_identity``): recompute's ``GPT``/``Llama`` by
their ``ModelSpec``, a transformers ``PreTrainedModel`` by its config, any other module by its parameters'
names and shapes and its modules' classes. A source (``--model``) is named the same way without building
anything, except a factory, which is built on the meta device (``source_identity``). So a plan made from a
config.json applies to the model ``from_pretrained`` loads, to ``AutoModelForCausalLM.from_config`` of the
same config, and to a factory returning either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from recompute.core.identity import ModelId, config_id, module_id, spec_id
from recompute.core.spec import ModelSpec
from recompute.models.hf import hf_config
from recompute.models.source import ModelSource, build_source, load_hf_config

__all__ = ["config_identity", "model_identity", "source_identity"]


def model_identity(model: nn.Module, *, name: str | None = None) -> ModelId:
    """The identity of a built model (``name``: how to call it; default: its spec's, config's or class name)."""
    spec = getattr(model, "spec", None)
    if isinstance(spec, ModelSpec):
        return spec_id(spec, name)
    config: Any = getattr(model, "config", None)
    if _is_transformers_model(model) and callable(getattr(config, "to_dict", None)):
        return config_id(config.to_dict(), name or _config_name(config, type(model).__name__))
    return module_id(
        ((n, tuple(p.shape)) for n, p in model.named_parameters()),
        ((n, type(m).__qualname__) for n, m in model.named_modules()),
        name or type(model).__name__,
    )


def config_identity(config: Any, *, name: str | None = None) -> ModelId:
    """The identity of the model a transformers config builds: a config.json path or its folder (named by the
    folder), a dict, or a config object (named by its hub name, else its ``model_type``); read through
    transformers, whose class fills in what the file leaves to defaults.

    Raises:
        ConfigError: not a decoder-only causal LM's config (``load_hf_config``).
    """
    if isinstance(config, (str, Path)):  # named by its folder, as the plan made from it
        return config_id(load_hf_config(config).to_dict(), name or ModelSource.from_config(config).name)
    loaded = load_hf_config(config)
    return config_id(loaded.to_dict(), name or _config_name(loaded, str(loaded.model_type)))


def source_identity(source: ModelSource) -> ModelId:
    """The identity of what ``source`` builds: a preset's spec (``hf:NAME``: the transformers config made from
    it), a config's architecture, or a factory's module built on the meta device.

    Raises:
        ConfigError: a factory that cannot be built.
    """
    if source.spec is not None:
        if source.hf:
            return config_id(hf_config(source.spec).to_dict(), source.name)
        return spec_id(source.spec)
    if source.config is not None:
        return config_id(source.config.to_dict(), source.name)
    return model_identity(build_source(source, device="meta").model, name=source.name)


def _is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by its class hierarchy: no transformers import)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(model).__mro__)


def _config_name(config: Any, default: str) -> str:
    """A config's hub name or path (``_name_or_path``), else ``default``."""
    return str(getattr(config, "name_or_path", "") or default)

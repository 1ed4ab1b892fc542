"""What ``--model`` names, and how to build it: a preset, a transformers config, or the user's own factory.

Three kinds of source (``resolve_source``):

- a preset name (``gpt2``, ``llama3.1-8b``; ``hf:NAME`` for transformers' GPT-2/Llama of that shape): recompute's
  reference model of the preset's ``ModelSpec``;
- a transformers ``config.json``, or a directory holding one: the class ``AutoModelForCausalLM.from_config``
  builds for it (dense or MoE, whatever it is), random weights, no download. Nothing builds a substitute;
- ``package.module:factory``: ``factory()`` is called with no arguments and must return an ``nn.Module``.

Note: [factory convention] A factory's module is run as a causal LM on random token ids: a model with a
``config.vocab_size`` (a transformers ``PreTrainedModel``) as ``model(input_ids=idx, labels=targets).loss``,
any other as ``logits, loss = model(idx, targets)`` (recompute's and nanoGPT's convention). Token ids are drawn
below ``config.vocab_size``, else below the first ``nn.Embedding``'s ``num_embeddings``. The factory is called
under ``with torch.device(...)`` (``meta`` for a trace), so it should create its parameters without naming a
device; the transformer layers are found by structure (``recompute.checkpointing.find_layers``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recompute.core.errors import ConfigError, first_line, one_of
from recompute.core.files import config_named, is_path
from recompute.core.presets import PRESETS
from recompute.core.raw_config import check_config
from recompute.core.spec import HF_ALIASES, ModelSpec, check_model_text, hf_config_dict
from recompute.core.workload import ATTENTIONS
from recompute.models import build_model, model_class
from recompute.models.hf import HF_ATTENTION, build_hf_model, hf_class_name, transformers_module
from recompute.models.loss import LossFn, hf_loss, lm_loss

__all__ = ["BuiltModel", "ModelSource", "build_source", "load_hf_config", "meta_copy", "resolve_source"]


@dataclass(frozen=True)
class ModelSource:
    """A model to build: a preset ``spec``, a transformers ``config``, or a ``factory``."""

    name: str
    """How results name it: the preset, the config's folder (the stem of a config file not named config.json),
    or ``module:factory``."""
    origin: str
    """Where it comes from, in words: ``the gpt2 spec``, ``config.json``, ``mypkg.models:build``."""
    spec: ModelSpec | None = None
    hf: bool = False
    """For a preset: build transformers' GPT-2/Llama of the spec instead of recompute's reference model."""
    config: Any = None
    """A transformers ``PretrainedConfig``."""
    factory: Callable[[], nn.Module] | None = field(default=None, compare=False)
    raw: dict[str, Any] | None = field(default=None, compare=False)
    """A config source's config.json as read (its identity for the profile store: ``recompute.trace.profile_key``)."""

    @classmethod
    def preset(cls, spec: ModelSpec, *, hf: bool = False) -> ModelSource:
        return cls(name=spec.name, origin=f"the {spec.name} spec", spec=spec, hf=hf)

    @classmethod
    def from_config(cls, config: Any, *, name: str | None = None) -> ModelSource:
        """A source from a config.json path (or its folder), a dict, or a transformers config object."""
        cfg = load_hf_config(config)
        raw = hf_config_dict(config)
        origin = f"{type(cfg).__name__}"
        if isinstance(config, (str, Path)):
            named, origin = config_named(config)
            name = name or named
        return cls(name=name or str(cfg.model_type), origin=origin, config=cfg, raw=raw)

    @classmethod
    def from_module(cls, model: nn.Module) -> ModelSource:
        """A source for a model already built: recompute's GPT/Llama by their spec, a transformers model by its
        config (its own class rebuilt), any other module by a copy of it on the meta device (its weights are
        neither copied nor touched)."""
        spec = getattr(model, "spec", None)
        if isinstance(spec, ModelSpec):
            return cls.preset(spec)
        config = getattr(model, "config", None)
        if config is not None and type(config).__name__.endswith("Config") and hasattr(config, "to_dict"):
            return cls.from_config(config, name=getattr(config, "_name_or_path", None) or None)
        name = f"{type(model).__module__}.{type(model).__name__}"
        return cls(name=name, origin=f"a {type(model).__name__} instance", factory=lambda: meta_copy(model))

    @property
    def kind(self) -> str:
        """``preset``, ``config`` or ``factory``."""
        return "preset" if self.spec is not None else "config" if self.config is not None else "factory"

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model takes, when the source says (``None``: no limit known)."""
        if self.spec is not None:
            return self.spec.max_positions
        found = getattr(self.config, "max_position_embeddings", None) if self.config is not None else None
        return found if isinstance(found, int) and found > 0 else None  # XLNet says -1: no limit

    @property
    def n_layers(self) -> int | None:
        """The transformer layer count, when known without building (``None`` for a factory)."""
        if self.spec is not None:
            return self.spec.n_layers
        return int(self.config.num_hidden_layers) if self.config is not None else None


@dataclass(frozen=True)
class BuiltModel:
    """A model built from a source, with what it takes to run a training step of it."""

    model: nn.Module
    loss_fn: LossFn
    vocab: int
    """Token ids are drawn below this."""
    class_name: str
    """The class built, with its package: ``transformers.MixtralForCausalLM``, ``recompute.models.GPT``."""
    notes: tuple[str, ...] = ()
    """What differs from what was asked (an attention implementation transformers refused, ...)."""

    @property
    def hf(self) -> bool:
        """Whether the model follows transformers' convention (``hf_loss``): ``model(input_ids=...).logits``."""
        return getattr(self.loss_fn, "convention", self.loss_fn) is hf_loss


@dataclass(frozen=True)
class _FactoryLoss:
    """A factory's loss convention (Note: [factory convention]); a refusal names the factory."""

    origin: str
    convention: LossFn

    def __call__(self, model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        try:
            return self.convention(model, idx, targets)
        except ConfigError as e:
            raise ConfigError(f"--model {self.origin!r}: {e}") from None
        except (Exception, SystemExit) as e:  # the factory's forward: whatever it raises, one line naming it
            raise ConfigError(f"--model {self.origin!r}: {type(model).__name__}.forward {_raised(e)}") from e


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (shared ones stay shared)."""
    memo: dict[int, Any] = {}
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def resolve_source(text: str) -> ModelSource:
    """``--model``: a preset (``hf:NAME`` for transformers' class), a config.json or its folder, or ``module:factory``.

    Raises:
        ConfigError: none of these (the message lists the forms), or the config/factory is unusable.
    """
    check_model_text(text)
    base = text.removeprefix("hf:")
    if base in PRESETS or (text.startswith("hf:") and base in HF_ALIASES):
        return ModelSource.preset(ModelSpec.from_name(HF_ALIASES.get(base, base)), hf=base != text)
    if is_path(text):  # a dangling link or a loop too: the reader says which
        return ModelSource.from_config(text)
    return ModelSource(name=text, origin=text, factory=_import_factory(text))


def load_hf_config(config: Any) -> Any:
    """A transformers config for a decoder-only causal LM, from a path, a dict or a config object.

    Raises:
        ConfigError: unreadable, an encoder-only, encoder-decoder or multimodal model, a model_type without a
            causal-LM class in transformers, or a config.json missing the hidden size, layers, heads or vocab.
    """
    transformers = transformers_module()
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    raw = hf_config_dict(config)
    kind = raw.get("model_type")
    if raw.get("is_encoder_decoder") or any(k in raw for k in ("text_config", "vision_config", "audio_config")):
        raise ConfigError(
            f"{kind or 'this config'} is an encoder-decoder or multimodal model; recompute builds decoder-only "
            "causal LMs: pass such a model's config.json (or its text model's)"
        )
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model_type {kind!r} has no causal-LM class in transformers {transformers.__version__} "
            "(AutoModelForCausalLM); pass the config.json of a decoder-only causal LM"
        )
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not raw.get("is_decoder"):
        raise ConfigError(
            f"model_type {kind!r} is an encoder-only model (masked LM); recompute builds decoder-only causal LMs"
        )
    if not isinstance(config, transformers.PretrainedConfig):
        check_config(raw, kind)
        try:
            config = transformers.AutoConfig.for_model(**raw)
        except Exception as e:  # transformers' field validation: TypeError, ValueError, its own errors
            raise ConfigError(f"transformers refuses the {kind} config: {type(e).__name__}: {first_line(e)}") from e
    return copy.deepcopy(config)


def build_source(
    source: ModelSource,
    *,
    attention: str = "flash",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    n_layers: int | None = None,
) -> BuiltModel:
    """Build ``source`` with random weights on ``device`` (``meta`` for a trace), cut to ``n_layers`` if given.

    Args:
        attention: ``flash`` (transformers' ``sdpa``; ``eager`` where a class refuses it, said in the notes)
            or ``eager``. A factory's model keeps its own attention.
        n_layers: build this many transformer layers (presets and configs; a factory builds what it builds).

    Raises:
        ConfigError: the model cannot be built (the message names the reason).
    """
    one_of("attention", attention, ATTENTIONS)
    if source.spec is not None:
        return _build_preset(source.spec, source.hf, attention, dtype, device, n_layers)
    if source.config is not None:
        return _build_config(source, attention, dtype, device, n_layers)
    assert source.factory is not None
    return _build_factory(source, dtype, device, n_layers)


def _build_preset(
    spec: ModelSpec, hf: bool, attention: str, dtype: torch.dtype, device: str | torch.device, n: int | None
) -> BuiltModel:
    small = dataclasses.replace(spec, n_layers=n) if n is not None and n != spec.n_layers else spec
    if hf:
        model = build_hf_model(small, attention=attention, dtype=dtype, device=device)
        return BuiltModel(model, hf_loss, spec.vocab, f"transformers.{hf_class_name(spec)}")
    model = build_model(small, attention=attention, dtype=dtype, device=device)
    return BuiltModel(model, lm_loss, spec.vocab, f"recompute.models.{model_class(spec).__name__}")


def _build_config(
    source: ModelSource, attention: str, dtype: torch.dtype, device: str | torch.device, n: int | None
) -> BuiltModel:
    transformers = transformers_module()

    cfg = copy.deepcopy(source.config)
    if n is not None and n != cfg.num_hidden_layers:
        cfg.num_hidden_layers = n
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:n]
    notes: list[str] = []
    impl = HF_ATTENTION[attention]
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
        except ValueError as e:
            if impl != "sdpa" or "does not support" not in str(e):
                raise ConfigError(f"transformers cannot build {source.origin}: {first_line(e)}") from e
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            notes.append(
                f"{type(model).__name__} does not support sdpa attention in transformers "
                f"{transformers.__version__}; built with its eager attention instead"
            )
        except Exception as e:  # a config the class rejects
            raise ConfigError(f"transformers cannot build {source.origin}: {type(e).__name__}: {first_line(e)}") from e
    name = f"transformers.{type(model).__name__}"
    return BuiltModel(model.to(dtype=dtype), hf_loss, int(cfg.vocab_size), name, tuple(notes))


def _build_factory(source: ModelSource, dtype: torch.dtype, device: str | torch.device, n: int | None) -> BuiltModel:
    assert source.factory is not None
    with torch.device(device):
        try:
            model = source.factory()
        except (Exception, SystemExit) as e:  # the user's code: whatever it raises, one line naming it
            raise ConfigError(f"--model {source.origin!r}: {source.origin}() {_raised(e)}") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{source.origin}() returned {type(model).__name__}, expected an nn.Module; return the model")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    loss_fn = _FactoryLoss(source.origin, hf_loss if vocab is not None else lm_loss)
    if vocab is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise ConfigError(
                f"{source.origin}() returned a {type(model).__name__} with no config.vocab_size and no nn.Embedding; "
                "recompute runs causal LMs on token ids"
            )
        vocab = embedding.num_embeddings
    name = f"{type(model).__module__}.{type(model).__name__}"
    return BuiltModel(model.to(dtype=dtype), loss_fn, int(vocab), name)


def _import_factory(text: str) -> Callable[[], nn.Module]:
    module_name, attr = text.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"--model {text!r}: cannot import {module_name} ({e}); put it on PYTHONPATH") from e
    except (Exception, SystemExit) as e:  # the user's module ran: SyntaxError, RuntimeError, sys.exit(0), ...
        raise ConfigError(f"--model {text!r}: importing {module_name} {_raised(e)}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(
            f"--model {text!r}: {module_name} has no callable {attr!r}; name a function returning an nn.Module"
        )
    return factory  # type: ignore[no-any-return]


def _raised(e: BaseException) -> str:
    """What the user's code did, in a few words: ``raised SyntaxError: ... (line 3)``, ``called sys.exit(0)``."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}); a factory and its module must return, not exit"
    where = f" ({Path(e.filename).name}, line {e.lineno})" if isinstance(e, SyntaxError) and e.filename else ""
    said = first_line(e) if not isinstance(e, SyntaxError) else e.msg
    return f"raised {type(e).__name__}" + (f": {said}" if said else "") + where  # MemoryError() says nothing

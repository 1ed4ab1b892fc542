"""Kinds of layer in a model, and short models made of copies of some of its layers (on the meta device).

Layers are of one kind when they have the same class, the same parameters (names, shapes and dtypes), the same
attention type and the same settings (the bool, int and str attributes of the layer and its sub-modules, such
as ``use_rope``, ``is_sliding`` or ``sliding_window``; the layer's own index is not a setting). Layers are
never assumed alike otherwise: ``profile`` measures each kind, and a scaled ``trace`` scales runs of alike
layers only (``_scale.py``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from recompute.core.errors import ConfigError
from recompute.models.source import BuiltModel

__all__ = ["Kinds", "Run", "layer_kinds", "ranges", "runs_of", "short_model"]

_INDEX = re.compile(r"(^|_)(idx|id|index|number)$")
"""Attributes that hold a layer's position (``layer_idx``, ``layer_id``, ``layer_number``), not a setting."""


@dataclass(frozen=True)
class Kinds:
    """Each layer's kind, the first layer of each kind, and each kind in words."""

    kind_of: tuple[int, ...]
    reps: tuple[int, ...]
    labels: tuple[str, ...]

    def members(self, k: int) -> tuple[int, ...]:
        """The layers of kind ``k``."""
        return tuple(i for i, x in enumerate(self.kind_of) if x == k)

    def describe(self) -> str:
        """``LlamaDecoderLayer, LlamaMLP (layers 0-2); LlamaDecoderLayer, LlamaMoE (layers 3-60)``."""
        return "; ".join(f"{label} ({ranges(self.members(k))})" for k, label in enumerate(self.labels))


@dataclass(frozen=True)
class Run:
    """Consecutive layers of one kind: ``length`` layers from ``start``."""

    kind: int
    start: int
    length: int


def layer_kinds(model: nn.Module, layers: nn.ModuleList) -> Kinds:
    """The kinds of ``layers`` (see the module docstring)."""
    types = _layer_types(model, len(layers))
    signatures: dict[Any, int] = {}
    kind_of: list[int] = []
    reps: list[int] = []
    labels: list[str] = []
    for i, layer in enumerate(layers):
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
        attention = types[i] if types else getattr(layer, "attention_type", None)
        sig = (type(layer).__name__, params, str(attention), _settings(layer))
        if sig not in signatures:
            signatures[sig] = len(reps)
            reps.append(i)
            labels.append(_label(layer, attention))
        kind_of.append(signatures[sig])
    return Kinds(tuple(kind_of), tuple(reps), tuple(labels))


def _settings(layer: nn.Module) -> tuple[tuple[str, str, Any], ...]:
    """The bool, int, str and None attributes of the layer and its sub-modules, but for its index.

    Floats are left out: they scale values (DiffLlama's per-layer ``lambda_init``), not what is allocated.
    """
    out = []
    for path, m in layer.named_modules():
        for name, value in vars(m).items():
            if name.startswith("_") or name == "training" or _INDEX.search(name):
                continue
            if value is None or isinstance(value, (bool, int, str)):
                out.append((path, name, value))
    return tuple(sorted(out, key=lambda x: (x[0], x[1])))


def runs_of(kind_of: Sequence[int]) -> tuple[Run, ...]:
    """The runs of consecutive layers of one kind, in order."""
    out: list[Run] = []
    for i, k in enumerate(kind_of):
        if out and out[-1].kind == k:
            out[-1] = Run(k, out[-1].start, out[-1].length + 1)
        else:
            out.append(Run(k, i, 1))
    return tuple(out)


def _layer_types(model: nn.Module, n: int) -> list[str] | None:
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return list(types)[:n] if isinstance(types, (list, tuple)) and len(types) >= n else None


def _label(layer: nn.Module, attention: Any) -> str:
    mlp = next(
        (type(m).__name__ for name, m in layer.named_children() if any(k in name for k in ("mlp", "moe", "ffn"))),
        None,
    )
    parts = [type(layer).__name__]
    if attention:
        parts.append(str(attention))
    if mlp:
        parts.append(mlp)
    return ", ".join(parts)


def short_model(whole: BuiltModel, layers: nn.ModuleList, picks: Sequence[int]) -> BuiltModel:
    """A meta copy of the model whose layers are copies of ``layers[i]`` for each ``i`` in ``picks``, in order."""
    model = whole.model
    parent, attr = _owner(model, layers)
    path = next(name for name, m in model.named_modules() if m is parent)
    setattr(parent, attr, nn.ModuleList())  # deepcopy the rest of the model without the whole layer list
    try:
        short = copy.deepcopy(model)
    finally:
        setattr(parent, attr, layers)
    copies = nn.ModuleList(copy.deepcopy(layers[i]) for i in picks)
    for position, layer in enumerate(copies):
        for m in layer.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.__dict__["layer_idx"] = position  # transformers' KV cache is indexed by it during the forward
    setattr(short.get_submodule(path), attr, copies)
    config = getattr(short, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        types = _layer_types(model, len(layers))
        config.num_hidden_layers = len(picks)
        if types:
            config.layer_types = [types[i] for i in picks]
    return BuiltModel(short, whole.loss_fn, whole.vocab, whole.class_name, whole.notes)


def _owner(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, child in module.named_children():
            if child is target:
                return module, name
    raise ConfigError(f"cannot find the layer list in {type(model).__name__}")


def ranges(layers: Sequence[int], *, limit: int = 8) -> str:
    """``layers 0-3, 5, 7-9`` (at most ``limit`` ranges, then how many more)."""
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    more = f", ... ({len(out) - limit} more)" if len(out) > limit else ""
    return "layers " + ", ".join(out[:limit]) + more

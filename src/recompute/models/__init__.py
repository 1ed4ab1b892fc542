"""Reference models, built from a ``ModelSpec``: GPT-2 (``GPT``) and Llama (``Llama``).

Both expose ``model.layers`` (an ``nn.ModuleList`` of pre-norm blocks with ``norm1``, ``attn``, ``norm2``,
``mlp``), an attention ``core(q, k, v)`` that ``core_attn`` recomputes, and
``forward(idx, targets=None) -> (logits, loss_or_None)``.

Example:
    >>> from recompute import ModelSpec
    >>> model = build_model(ModelSpec(hidden=64, n_layers=2, n_heads=4, vocab=128, max_positions=32))
    >>> type(model).__name__, len(model.layers)
    ('GPT', 2)
"""

from __future__ import annotations

import torch
from torch import nn

import recompute._compat  # noqa: F401  (a torch outside the supported range: one ConfigError, here)
from recompute.core.errors import ConfigError, one_of
from recompute.core.spec import ModelSpec
from recompute.core.workload import ATTENTIONS
from recompute.models.gpt import GPT
from recompute.models.llama import Llama

__all__ = ["GPT", "Llama", "build_model", "model_class"]


def model_class(spec: ModelSpec) -> type[GPT] | type[Llama]:
    """The reference class ``build_model`` builds for ``spec``: ``GPT`` for a GELU MLP, ``Llama`` for SwiGLU."""
    return GPT if spec.mlp == "gelu" else Llama


def build_model(
    spec: ModelSpec,
    *,
    attention: str = "flash",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A randomly initialised reference model for ``spec``: ``GPT`` for a GELU MLP, ``Llama`` for SwiGLU.

    Args:
        spec: the model's shape; GPT needs learned positions, Llama rotary ones.
        attention: ``eager`` (math written out, saves the s^2 softmax) or ``flash``
            (``F.scaled_dot_product_attention``).
        dtype: parameter (and so activation) dtype.
        device: where the parameters live; built there directly.

    Raises:
        ConfigError: an unknown attention, or a position kind the architecture does not have.
    """
    one_of("attention", attention, ATTENTIONS)
    if not spec.reference:
        raise ConfigError(
            f"{spec.name} has features of transformers' classes (experts, q/k norms, ...) that recompute's reference "
            "GPT/Llama do not build; build it from its config.json (`--model config.json`)"
        )
    cls = model_class(spec)
    position = "learned" if cls is GPT else "rotary"
    if spec.position != position:
        raise ConfigError(
            f"{cls.__name__} ({spec.mlp} MLP) uses {position} positions but the spec asks for {spec.position}; "
            f"set position={position!r}"
        )
    with torch.device(device):
        model = cls(spec, attention=attention)
    return model.to(dtype=dtype)

"""The loss conventions of the models recompute runs: one function per kind of model.

A loss function takes ``(model, idx, targets)`` and returns ``(output, loss)``; the output is kept alive with
the loss, as in a training loop that logs it. A model that breaks its convention (a factory's forward that
returns the logits alone, say) is refused in one line (``ConfigError``) the first time it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from recompute.core.errors import ConfigError

__all__ = ["LossFn", "hf_loss", "lm_loss", "loss_fn_for"]

LossFn = Callable[[nn.Module, Tensor, Tensor], tuple[Any, Tensor]]


def lm_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[Any, Tensor]:
    """Loss of recompute's reference models: ``model(idx, targets) -> (logits, loss)``.

    Raises:
        ConfigError: the model returned anything but a pair whose second item is a one-element tensor.
    """
    out = model(idx, targets)
    if not (isinstance(out, tuple | list) and len(out) == 2 and _scalar(out[1])):
        raise ConfigError(
            f"{type(model).__name__}(idx, targets) returned {_described(out)}, expected (logits, loss) with a "
            "one-element loss tensor; follow that convention or give the model a transformers config"
        )
    return out[0], out[1]


def hf_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[Any, Tensor]:
    """Loss of a Hugging Face causal LM: ``model(input_ids, labels)``; keeps the whole output alive.

    Raises:
        ConfigError: the output has no one-element ``loss`` tensor.
    """
    out = model(input_ids=idx, labels=targets)
    loss = getattr(out, "loss", None)
    if not isinstance(loss, Tensor) or not _scalar(loss):
        raise ConfigError(
            f"{type(model).__name__}(input_ids=..., labels=...) returned {_described(out)} without a one-element "
            "loss tensor in .loss; return a transformers CausalLMOutput (or follow recompute's (logits, loss))"
        )
    return out, loss


def _scalar(value: object) -> bool:
    return isinstance(value, Tensor) and value.numel() == 1


def _described(value: object) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def loss_fn_for(hf: bool) -> LossFn:
    """``hf_loss`` for a transformers model, ``lm_loss`` for recompute's own."""
    return hf_loss if hf else lm_loss

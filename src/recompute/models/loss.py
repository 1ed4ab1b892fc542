"""The loss conventions of the models recompute runs: one function per kind of model.

A loss function takes ``(model, idx, targets)`` and returns ``(output, loss)``; the output is kept alive with
the loss, as in a training loop that logs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

__all__ = ["LossFn", "hf_loss", "lm_loss", "loss_fn_for"]

LossFn = Callable[[nn.Module, Tensor, Tensor], tuple[Any, Tensor]]


def lm_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[Any, Tensor]:
    """Loss of recompute's reference models: ``model(idx, targets) -> (logits, loss)``."""
    logits, loss = model(idx, targets)
    return logits, loss


def hf_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[Any, Tensor]:
    """Loss of a Hugging Face causal LM: ``model(input_ids, labels)``; keeps the whole output alive."""
    out = model(input_ids=idx, labels=targets)
    return out, out.loss


def loss_fn_for(hf: bool) -> LossFn:
    """``hf_loss`` for a transformers model, ``lm_loss`` for recompute's own."""
    return hf_loss if hf else lm_loss

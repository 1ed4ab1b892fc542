"""Build a model to trace, without allocating it: on the meta device, then turned into fake tensors.

``build_model(..., device="meta")`` makes every parameter a meta tensor (shape and dtype, no data);
``fakeify`` swaps each for a ``FakeTensor`` of the same shape on the CPU, owned by a ``FakeTensorMode``, so
a full forward and backward run with exact sizes and no memory. Weight tying is kept (one fake per parameter
object).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from recompute.core.errors import ConfigError
from recompute.core.spec import ModelSpec
from recompute.models import build_model
from recompute.models.hf import build_hf_model

__all__ = ["build_meta", "fakeify"]


def fakeify(model: nn.Module, mode: FakeTensorMode, device: str = "cpu") -> nn.Module:
    """Replace ``model``'s parameters and buffers (meta or real) by fake tensors on ``device``, in place."""
    memo: dict[int, Tensor] = {}

    def fake(t: Tensor, param: bool) -> Tensor:
        if id(t) not in memo:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if param else f
        return memo[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p, True)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)
    return model


def build_meta(spec: ModelSpec, *, attention: str, dtype: torch.dtype, hf: bool = False) -> nn.Module:
    """recompute's reference model (or the Hugging Face one, ``hf=True``) for ``spec`` on the meta device.

    Raises:
        ConfigError: the model cannot be built (the message names the reason).
    """
    try:
        if hf:
            return build_hf_model(spec, attention=attention, dtype=dtype, device="meta")
        return build_model(spec, attention=attention, dtype=dtype, device="meta")
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError(f"cannot build {spec.name}: {e}; install it (pip install recompute[hf])") from e
    except Exception as e:  # a model class that rejects this shape
        raise ConfigError(f"cannot build {spec.name}: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]

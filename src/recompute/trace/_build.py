"""Build a model to trace, without allocating it: on the meta device, then turned into fake tensors.

``build_model(..., device="meta")`` makes every parameter a meta tensor (shape and dtype, no data);
``fakeify`` swaps each for a ``FakeTensor`` of the same shape on the CPU, owned by a ``FakeTensorMode``, so
a full forward and backward run with exact sizes and no memory. Weight tying is kept (one fake per parameter
object).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from recompute._compat import drop_library
from recompute.core.errors import ConfigError, first_line
from recompute.models.source import BuiltModel, ModelSource, build_source

__all__ = ["build_meta", "fake_kernels", "fakeify"]


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


def build_meta(source: ModelSource, *, attention: str, dtype: torch.dtype, n_layers: int | None = None) -> BuiltModel:
    """``source`` on the meta device (cut to ``n_layers``), ready for ``fakeify``.

    Raises:
        ConfigError: the model cannot be built (the message names the reason).
    """
    try:
        return build_source(source, attention=attention, dtype=dtype, device="meta", n_layers=n_layers)
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError(f"cannot build {source.name}: {e}; install it (pip install recompute[hf])") from e
    except Exception as e:  # a model class that rejects this shape
        raise ConfigError(f"cannot build {source.name}: {type(e).__name__}: {first_line(e)}") from e


@contextlib.contextmanager
def fake_kernels() -> Iterator[None]:
    """Shape rules (and a deep copy) fake tensors need beyond PyTorch's own, for the trace's duration.

    Note: [grouped_mm on fake tensors] transformers' MoE experts (``grouped_mm_experts_forward``) sort the
    routed tokens by expert and run ``aten._grouped_mm`` over all b*s*top_k rows with per-expert offsets, so
    every tensor's size is fixed whatever the routing (no load assumption needed). PyTorch's meta kernel for
    ``_grouped_mm`` holds every dtype to CUDA's bf16-only rule, while the CPU kernel takes any float dtype;
    this registers the shape rule alone (removed on exit) so an fp32 trace runs the op a real CPU step runs.

    Note: [deepcopy of a fake tensor] Dory's forward deep-copies its cache layers (one copy per recurrent
    loop), and a sliding-window layer holds ``torch.tensor(window)``: made under the fake mode, that fake tensor
    keeps the real constant it was made from, and ``Tensor.__deepcopy__`` copies it too, a CPU storage set on a
    meta tensor, which PyTorch refuses. For the trace's duration a fake tensor deep-copies as a real one does
    (a new storage of the same size, the same strides and offset; ``requires_grad`` kept), in fake tensors.
    """
    lib = torch.library.Library("aten", "IMPL")
    with contextlib.suppress(RuntimeError):  # a PyTorch with its own Python meta rule (2.11): that one stands
        lib.impl("_grouped_mm", _grouped_mm_meta, "Meta")
    own = FakeTensor.__dict__.get("__deepcopy__")  # a nested trace's, or none (torch.Tensor's)
    FakeTensor.__deepcopy__ = _fake_deepcopy  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own  # type: ignore[method-assign]
        drop_library(lib)


def _fake_deepcopy(self: FakeTensor, memo: dict[int, Any]) -> Tensor:
    """``copy.deepcopy`` of a fake tensor: a fake copy of its whole storage, viewed as ``self`` is."""
    if id(self) not in memo:  # inside the trace's modes (the tracker sees the allocation), or in its fake mode
        with contextlib.nullcontext() if active_fake_mode() is self.fake_mode else self.fake_mode:
            base = torch.empty(self.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device)
            new = base.view(self.dtype).as_strided(self.size(), self.stride(), self.storage_offset())
        memo[id(self)] = new.requires_grad_(self.requires_grad)
    return memo[id(self)]


def _grouped_mm_meta(
    a: Tensor, b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Output of ``_grouped_mm(a, b, offs)``: 2d x 3d and 3d x 2d -> (m, n); 3d x 3d and 2d x 2d -> (g, m, n)."""
    if a.dim() == 2 and b.dim() == 2:
        assert offs is not None
        shape: tuple[int, ...] = (offs.size(0), a.size(0), b.size(1))
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.size(0), a.size(1), b.size(-1))
    else:
        shape = (a.size(-2), b.size(-1))
    return a.new_empty(shape, dtype=out_dtype or a.dtype)

"""Kernels that the analytic model's Llama figures describe, and that older supported torch releases lack.

The trace runs the kernels of the torch it runs on, so on these releases it (rightly) differs from the formulas,
which describe torch 2.10 to 2.13 (issue 34). Each is probed by what torch does, not by its version:

- ``CPU_FLASH_GQA``: the CPU's SDPA takes grouped-query attention (``enable_gqa``) in its flash kernel; torch
  2.6 and 2.8 run its math path, which keeps the s^2 scores;
- ``FUSED_RMS_NORM``: ``F.rms_norm`` calls the fused kernel (input and fp32 rstd kept) where the device has one,
  as CUDA does from 2.10 (``recompute.trace._cuda`` registers one for a CUDA trace); torch 2.6 and 2.8 always
  decompose it, on CUDA too;
- ``FP32_RMS_NORM``: the decomposition keeps its normalized input in fp32 (2.6 casts it back first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from recompute.trace._cuda import cuda_rules

__all__ = ["CPU_FLASH_GQA", "FP32_RMS_NORM", "FUSED_RMS_NORM", "cpu_flash_gqa", "fp32_rms_norm", "fused_rms_norm"]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(str(func._overloadpacket))
        return func(*args, **(kwargs or {}))


def _dispatched(run: Callable[[], object]) -> set[str]:
    with _Ops() as ops:
        run()
    return ops.names


def _sdpa_gqa() -> object:
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


def _rms_norm_keeps_fp32() -> bool:
    """Whether every (4, 64) tensor a bf16 RMSNorm saves is fp32."""
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.rms_norm(x, (64,), torch.ones(64, dtype=torch.bfloat16, requires_grad=True), 1e-6)
    return all(t.dtype == torch.float32 for t in saved if t.shape == x.shape)


def _fused_under_cuda_rules() -> bool:
    with cuda_rules(), FakeTensorMode():  # the registered CPU kernel is never run: fake tensors take the meta one
        x = torch.randn(4, 64)
        return "aten._fused_rms_norm" in _dispatched(lambda: F.rms_norm(x, (64,)))


CPU_FLASH_GQA = "aten._scaled_dot_product_flash_attention_for_cpu" in _dispatched(_sdpa_gqa)
FUSED_RMS_NORM = _fused_under_cuda_rules()
FP32_RMS_NORM = _rms_norm_keeps_fp32()

_THIS = f"torch {torch.__version__}"
cpu_flash_gqa = pytest.mark.skipif(
    not CPU_FLASH_GQA,
    reason=f"{_THIS}'s CPU SDPA runs grouped-query attention through its math path (s^2 scores kept); the analytic "
    "model counts the flash kernel",
)
fused_rms_norm = pytest.mark.skipif(
    not FUSED_RMS_NORM,
    reason=f"{_THIS} has no fused RMSNorm on CUDA (F.rms_norm decomposes, fp32 copies kept); the analytic model "
    "counts the fused kernel",
)
fp32_rms_norm = pytest.mark.skipif(
    not FP32_RMS_NORM,
    reason=f"{_THIS}'s RMSNorm decomposition keeps a bf16 product where later ones keep fp32, as the analytic "
    "model counts",
)

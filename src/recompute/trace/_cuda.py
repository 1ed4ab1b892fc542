"""A CUDA step traced without CUDA: fake CPU tensors under CUDA's rules (``--device cuda`` on any machine).

Fake tensors run no kernel, so a CUDA step can be traced on the CPU wherever the device decides only which
kernel runs and what it keeps for the backward. Fake CUDA tensors themselves cannot stand in: on a CPU-only
build of PyTorch the autograd engine asks CUDA's device guard for a stream and the process aborts. What
CUDA does differently, and where this module sets it (``cuda_rules``, ``StepTracker(cuda=True)``):

- dropout (``F.dropout``): the fused kernel ``native_dropout``, which keeps a 1-byte mask, where the CPU
  multiplies by a mask in the activation dtype (``at::dropout`` fuses on CUDA only). In place, both devices
  take the unfused path.
- attention (``F.scaled_dot_product_attention``): the backend CUDA selects (``sdpa_backend``), called as
  ``at::scaled_dot_product_attention`` calls it, so autograd keeps what that kernel's formula saves:
  FlashAttention and memory-efficient attention keep the output, an fp32 log-sum-exp per row (the efficient
  kernel pads the rows to a multiple of 32) and the RNG state; the math path keeps the softmax (and, with
  dropout, the mask and the dropped probabilities).
- RMSNorm (``F.rms_norm``): the fused kernel ``_fused_rms_norm`` (its input and an fp32 rstd kept), which the
  CPU decomposes (fp32 copies kept). A CPU kernel registered for the trace's duration makes autograd take the
  fused op's own formula; the fake tensors never run it.
- LayerNorm: fp32 mean and rstd (the CPU's keep the input dtype): ``StepTracker`` converts them.
- scratch a kernel allocates and frees inside one call (``kernel_scratch``, which ``StepTracker`` counts; the CPU
  kernels and the meta functions make none): softmax's backward, a tensor as large as its gradient;
  FlashAttention's backward, fp32 accumulators and, under grouped-query attention, dK and dV for every head.
- AdamW: the multi-tensor (``foreach``) implementation, PyTorch's default for CUDA tensors.
- autocast (``precision`` amp): CUDA's policy of which op runs in which dtype, not the CPU's
  (``recompute.trace._autocast``); SDPA's inputs cast before its backend is chosen, as CUDA's autocast does.
- memory: every storage rounded up to 512 bytes, as the CUDA caching allocator and MemTracker count it.

Note: [SDPA's backend on CUDA] ``sdpa_backend`` follows PyTorch's ``select_sdp_backend``
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) for an sm80-sm90 GPU in the default order: FlashAttention
for fp16/bf16 without a mask, with equal head dims of at most 256 and the causal flag only with equal lengths;
else memory-efficient attention for fp16/bf16/fp32 with head dims divisible by 8 (16-bit) or 4 (fp32) and as
many key/value heads as query heads (its backward here takes no grouped-query attention); else the math path.
Not modelled: cuDNN attention, which recent PyTorch tries first on sm90/sm100 with cuDNN newer than 9.15 where
the head dim, the layout and the dropout probability (a multiple of 1/16) allow; it keeps the same tensors as
FlashAttention (the output, an fp32 log-sum-exp per row, the RNG state), and takes masks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from recompute._compat import drop_library
from recompute.core.errors import ConfigError
from recompute.trace._autocast import CUDA, autocast_inputs, emulated_autocast

__all__ = [
    "BLOCK",
    "cuda_rules",
    "fake_device_note",
    "fp32_statistics",
    "kernel_scratch",
    "sdpa_backend",
    "stands_in",
    "trace_device",
]

aten = torch.ops.aten

BLOCK = 512
"""Bytes a CUDA allocation is rounded up to (the caching allocator's smallest block; MemTracker's rule)."""


def trace_device(device: str) -> str:
    """The device the fake tensors of a step on ``device`` live on: CUDA where this PyTorch has it, else the
    CPU (under CUDA's rules for a CUDA step: ``stands_in``).

    Raises:
        ConfigError: ``device`` is neither cpu nor cuda.
    """
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}", fields=("device",))
    return "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"


def fake_device_note(device: str) -> str:
    """How a step on ``device`` is traced, in words (``on fake cuda tensors``)."""
    if stands_in(device, trace_device(device)):
        return (
            "on fake CPU tensors under CUDA's rules (no CUDA here: its dropout, attention and norm kernels, "
            "foreach AdamW, 512-byte blocks)"
        )
    return f"on fake {device} tensors"


def stands_in(device: str, tensors: str) -> bool:
    """Whether a step on ``device`` traced on fake ``tensors`` takes CUDA's rules from this module."""
    return device == "cuda" and tensors != "cuda"


@contextlib.contextmanager
def cuda_rules() -> Iterator[None]:
    """CUDA's dropout, attention and RMSNorm kernels and its autocast policy on the CPU, for the trace's duration
    (module docstring).

    The functions are swapped on ``torch.nn.functional`` (models look them up at call time), so a checkpoint's
    replay in the backward takes them too."""
    saved = F.dropout, F.scaled_dot_product_attention
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", _never_run, "CPU")
    F.dropout, F.scaled_dot_product_attention = _dropout, _sdpa  # type: ignore[assignment]
    try:
        with emulated_autocast(CUDA):
            yield
    finally:
        F.dropout, F.scaled_dot_product_attention = saved  # type: ignore[assignment]
        drop_library(lib)


def fp32_statistics(func: Any) -> Any:
    """``native_layer_norm`` with CUDA's fp32 mean and rstd (the fake CPU kernel keeps the input dtype)."""

    def layer_norm(*args: Any, **kwargs: Any) -> Any:
        out, mean, rstd = func(*args, **kwargs)
        return out, mean.float(), rstd.float()

    return layer_norm


def kernel_scratch(func: Any, args: tuple[Any, ...]) -> int:
    """Bytes CUDA's kernel for ``func`` allocates inside the call beyond its outputs, freed before it returns.

    Note: [softmax's backward on CUDA] ``softmax_backward_cuda_out`` (aten/src/ATen/native/cuda/SoftMax.cu)
    first computes ``Tensor tmp = grad * output;`` and hands ``tmp`` to the kernel (its epilogue computes
    ``tmp - output * sum(tmp)``), so the scratch has the broadcast shape and promoted dtype of the two, while
    the gradient it returns is already allocated (a structured kernel's output comes first). Eager attention's
    scores are the largest tensors of a step, so this (b, a, s, s) scratch lands on the step's peak: 1.000 GiB
    measured on an H100 above the trace of a 2-layer Llama at s = 4096, b = 1, 32 heads, bf16 (4096^2 * 32 * 2 B)
    under none, core_attn and block alike (issue 34). The CPU kernel and the meta function allocate nothing but
    the result, and ``log_softmax``'s CUDA backward makes no such copy.

    Note: [FlashAttention's backward on CUDA] ``mha_bwd`` (aten/src/ATen/native/transformers/cuda/flash_attn/
    flash_api.cpp) allocates, after dq, dk and dv: ``softmax_d``, fp32 (b, a, s_q rounded up to 128), which
    ``_flash_attention_backward`` drops; ``dq_accum``, fp32 (b, s_q rounded to 128, a, d rounded to 32, or to 64
    above 128), the non-deterministic kernel's accumulator; and with fewer key/value heads than query heads
    ``dk_expanded`` and ``dv_expanded``, (b, s_k, a, d) in the inputs' dtype, summed into dk and dv at the end.
    All live until the call returns. Not measured apart on a GPU (the H100 runs of issue 34 peaked elsewhere).
    """
    if func is aten._softmax_backward_data.default:
        grad, output = args[0], args[1]
        shape = torch.broadcast_shapes(grad.shape, output.shape)
        return math.prod(shape) * torch.promote_types(grad.dtype, output.dtype).itemsize
    if func is aten._scaled_dot_product_flash_attention_backward.default:
        return _flash_backward_scratch(query=args[1], key=args[2])
    return 0


def _flash_backward_scratch(*, query: Tensor, key: Tensor) -> int:
    """``mha_bwd``'s scratch for SDPA-layout (b, a, s, d) inputs (the note in ``kernel_scratch``)."""
    b, a, s_q, d = query.shape
    kv, s_k = key.size(-3), key.size(-2)
    rows = -(-s_q // 128) * 128
    d_accum = -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
    scratch = 4 * b * a * rows + 4 * b * rows * a * d_accum  # softmax_d, dq_accum
    if kv != a:
        scratch += 2 * b * s_k * a * d * query.element_size()  # dk_expanded, dv_expanded
    return scratch


def _never_run(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("recompute registers _fused_rms_norm on the CPU only to trace CUDA's step on fake tensors")


def _dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout`` as on CUDA: ``at::dropout`` takes the fused kernel (a bool mask) out of place."""
    if not training or p == 0.0 or inplace or not 0.0 < p < 1.0 or input.numel() == 0:
        return _CPU_DROPOUT(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


_CPU_DROPOUT = F.dropout


def sdpa_backend(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
) -> str:
    """``flash``, ``efficient`` or ``math``: the kernel CUDA runs for these inputs (the module's note)."""
    dq, dk, dv = query.size(-1), key.size(-1), value.size(-1)
    half = query.dtype in (torch.float16, torch.bfloat16)
    causal_ok = not is_causal or query.size(-2) == key.size(-2)
    if half and attn_mask is None and dq == dk == dv and dq <= 256 and causal_ok:
        return "flash"
    align = 8 if half else 4
    heads = query.size(-3) == key.size(-3) == value.size(-3)  # this PyTorch's efficient kernel takes no GQA
    if query.dtype in (torch.float16, torch.bfloat16, torch.float32) and dq == dk and dq % align == dv % align == 0:
        return "efficient" if heads else "math"
    return "math"


def _sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as ``at::scaled_dot_product_attention`` runs it on CUDA (under
    autocast, its inputs cast first: the backend is chosen for the dtype they reach the kernel in)."""
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)  # type: ignore[assignment]
    backend = sdpa_backend(query, key, value, attn_mask, is_causal)
    mask = _additive(attn_mask, query.dtype)
    if backend == "flash":
        head = query.size(-1)
        q, k, v = (_pad_last(t, 8) for t in (query, key, value))
        scale = scale if scale is not None else 1.0 / math.sqrt(head)
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head] if out.size(-1) != head else out
    if backend == "efficient":
        grads = query.requires_grad or key.requires_grad or value.requires_grad
        mask = _efficient_mask(mask, query, key) if mask is not None else None
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, grads, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask as the additive one SDPA makes of it (``convert_boolean_attn_mask``)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _efficient_mask(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """The memory-efficient kernel's mask (``preprocess_mask``): expanded to (b, h, s_q, s_k), its last dimension
    padded to a multiple of 16 and sliced back, or made contiguous where its strides are not aligned."""
    b, h, s_q, s_k = query.size(0), query.size(1), query.size(-2), key.size(-2)
    mask = mask.expand(b, h, s_q, s_k)
    if s_k % 16:
        return F.pad(mask, (0, 16 - s_k % 16))[..., :s_k]
    if any(stride % 16 for stride in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def _pad_last(t: Tensor, multiple: int) -> Tensor:
    """FlashAttention's inputs padded to a head dim divisible by ``multiple`` (``pad_last_dim``)."""
    extra = -t.size(-1) % multiple
    return F.pad(t, (0, extra)) if extra else t

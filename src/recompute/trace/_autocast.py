"""A device's autocast policy on fake CPU tensors: CUDA's autocast for a CUDA step traced without CUDA.

``torch.autocast`` picks, op by op, the dtype an op runs in, and its policy differs by device
(aten/src/ATen/autocast_mode.h and .cpp): CUDA runs ``softmax``, ``log_softmax``, ``layer_norm``, ``rms_norm``
(2.12 and later), ``exp``, ``pow``, ``sum`` and the losses in fp32, where the CPU leaves most of them in the input's
dtype and runs ``cross_entropy_loss`` whole in fp32. What a step saves follows: under CUDA's autocast eager
attention keeps fp32 probabilities and a LayerNorm an fp32 copy of its input. A CUDA step traced on fake CPU
tensors (``recompute.trace._cuda``) meets the CPU's autocast kernels (the ``AutocastCPU`` dispatch key), so
``emulated_autocast`` registers, for the trace's duration, a kernel at that key for every op of a policy table,
written as the C++ wrappers are (``WrapFunction_`` for each ``CastPolicy``), and a fallthrough for every other op
the CPU casts. ``CUDA`` is CUDA's table; ``CPU`` is the CPU's own, so that a trace under the emulated CPU table
can be held to the real CPU autocast (tests/test_amp.py): the same casts, the same cache of cast weights.

Note: [the weight cache] autocast keeps the low-precision copy of an fp32 leaf that requires grad (a weight) from
its first cast until the outermost autocast region exits (``cached_cast``, ``clear_cache``): every layer's cast
weights live to the end of the forward, whatever a checkpoint drops, and a checkpoint's replay casts them again
inside its own region. The emulation keeps its own cache the same way and empties it where torch empties its
own (``torch.clear_autocast_cache``, which ``torch.autocast.__exit__`` calls at the outermost exit).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from recompute._compat import drop_library

__all__ = ["CPU", "CUDA", "AutocastTable", "autocast_inputs", "emulated_autocast"]

Casted = tuple[tuple[Any, ...], dict[str, Any]]
"""An op's arguments (positional, keyword) after a cast policy."""

KEY = "AutocastCPU"
"""The dispatch key of autocast on CPU tensors (the fake tensors a trace runs on)."""


@dataclass(frozen=True)
class AutocastTable:
    """One device's autocast policy: the ops of each cast policy (``aten`` names, ``op`` or ``op.overload``)."""

    name: str
    lower: tuple[str, ...]
    """``lower_precision_fp``: floating inputs cast to the autocast dtype (weights through the cache)."""
    fp32: tuple[str, ...]
    """``fp32``: floating inputs cast to fp32."""
    fp32_dtype: tuple[str, ...] = ()
    """``fp32_set_opt_dtype``: run with ``dtype=float32`` when none is given and the first input is floating."""
    promote: tuple[str, ...] = ()
    """``promote``: floating inputs cast to the widest floating dtype among them."""

    def ops(self) -> frozenset[str]:
        return frozenset((*self.lower, *self.fp32, *self.fp32_dtype, *self.promote))


def _cuda_table() -> AutocastTable:
    """CUDA's policy in the running torch (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
    ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE`` of aten/src/ATen/autocast_mode.h); ``rms_norm`` joined
    the fp32 ops in 2.12 (pytorch/pytorch#174824). tests/test_amp.py holds it to the header torch ships."""
    norm = ("rms_norm",) if _release() >= (2, 12) else ()
    return AutocastTable(
        "cuda",
        lower=(
            "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
            "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
            "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        ),
        fp32=(
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
            "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
            "native_layer_norm", *norm, "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
            "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
            "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
            "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
            "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
            "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
            "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
            "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        ),
        fp32_dtype=(
            "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
            "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
        ),
        promote=(
            "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add",
        ),
    )  # fmt: skip


CPU = AutocastTable(
    "cpu",
    lower=(
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
        "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
        "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
        "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
    ),
    fp32=(
        "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int", "quantile",
        "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist", "grid_sampler_2d",
        "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex", "cholesky", "cholesky_inverse",
        "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d",
        "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
        "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
        "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss.IntList",
        "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft",
        "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2",
        "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_cond.p_str",
        "linalg_matrix_rank", "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
        "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals",
        "linalg_eigvalsh", "linalg_inv", "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
        "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
        "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward",
        "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
    ),
    promote=("stack", "cat", "index_copy", "index_copy.dimname"),
)  # fmt: skip
"""The CPU's own policy (aten/src/ATen/autocast_mode.cpp, ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``): what the
emulation falls through for under another table, and, emulated itself, the check of the emulation."""


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


CUDA = _cuda_table()


@contextlib.contextmanager
def emulated_autocast(table: AutocastTable) -> Iterator[None]:
    """``table``'s policy for autocast on CPU tensors, for the context's duration (the module docstring).

    Only ops reached while ``torch.autocast("cpu", ...)`` is on take the kernels; outside it nothing changes.
    """
    cache = _Cache()
    lib = torch.library.Library("aten", "IMPL")
    policies: dict[str, Callable[..., Casted] | None] = dict.fromkeys(CPU.ops() - table.ops())  # None: fall through
    for ops, cast in (
        (table.lower, cache.lower),
        (table.fp32, _fp32),
        (table.fp32_dtype, _fp32_dtype),
        (table.promote, cache.promote),
    ):
        policies.update(dict.fromkeys(ops, cast))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the CPU's, restored on exit
        for op, policy in policies.items():
            with contextlib.suppress(RuntimeError, AttributeError):  # an overload this torch does not have
                lib.impl(op, torch.library.fallthrough_kernel if policy is None else _wrapped(op, policy), KEY)
    clear = torch.clear_autocast_cache

    def cleared() -> None:
        cache.casts.clear()
        clear()

    torch.clear_autocast_cache = cleared
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear
        drop_library(lib)


def autocast_inputs(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` as CUDA's ``lower_precision_fp`` wrapper casts an op's inputs while autocast is on (for the
    Python stand-ins of CUDA's kernels that choose a kernel by dtype before the op is dispatched: SDPA)."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    to = torch.get_autocast_dtype("cpu")
    return tuple(t.to(to) if _eligible(t) and t.dtype != to else t for t in tensors)  # type: ignore[union-attr]


def _eligible(x: Any) -> bool:
    """``is_eligible``: a floating tensor that is not float64."""
    return isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _wrapped(name: str, policy: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]) -> Callable[..., Any]:
    """A kernel for op ``name``: ``policy`` casts its arguments, then the op runs with autocast off, as
    ``WrapFunction_``'s guard runs it."""
    op = _op(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = policy(op, args, kwargs)
        with _autocast_off():
            return op(*args, **kwargs)

    return kernel


def _autocast_off() -> contextlib.AbstractContextManager[Any]:
    """The CPU's autocast key excluded (``ExcludeDispatchKeyGuard``; without that private guard, autocast
    disabled through its public switch, which also leaves the weight cache alone inside a region)."""
    guard = getattr(torch._C, "_ExcludeDispatchKeyGuard", None)
    if guard is None:
        return torch.autocast("cpu", enabled=False)
    return guard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))  # type: ignore[no-any-return]


def _map(fn: Callable[[Tensor], Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Casted:
    """``fn`` applied to every eligible tensor among the arguments, in lists too."""

    def one(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(one(y) for y in x)
        return fn(x) if _eligible(x) else x

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _fp32(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Casted:
    return _map(lambda t: t.float(), args, kwargs)


def _fp32_dtype(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Casted:
    """``fp32_set_opt_dtype``: a dtype of fp32 where none is given, when the first input is eligible."""
    if not _eligible(args[0]):
        return args, kwargs
    if op.overloadpacket in (torch.ops.aten.softmax, torch.ops.aten.log_softmax):  # (self, dim, dtype=None)
        if len(args) < 3 or args[2] is None:
            args = (*args[:2], torch.float32)
        return args, kwargs
    if kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


def _is_view(t: Tensor) -> bool:
    is_view = getattr(t, "_is_view", None)
    return bool(is_view()) if is_view is not None else t._base is not None


class _Cache:
    """The cast copies of weights one autocast region keeps (``cached_cast``), and the policies that read it."""

    def __init__(self) -> None:
        self.casts: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def cast(self, t: Tensor, to: torch.dtype) -> Tensor:
        if t.dtype == to:
            return t
        cacheable = (
            to == torch.get_autocast_dtype("cpu")
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not _is_view(t)
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(to)
        if t not in self.casts:
            self.casts[t] = t.to(to)
        return self.casts[t]  # type: ignore[no-any-return]

    def lower(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Casted:
        to = torch.get_autocast_dtype("cpu")
        return _map(lambda t: self.cast(t, to), args, kwargs)

    def promote(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Casted:
        """``promote``: fp32 if any eligible input is fp32, else the autocast dtype (float64 inputs ignored)."""
        found: list[torch.dtype] = []
        _map(lambda t: found.append(t.dtype) or t, args, kwargs)  # type: ignore[func-returns-value]
        to = torch.float32 if torch.float32 in found else torch.get_autocast_dtype("cpu")
        return _map(lambda t: self.cast(t, to), args, kwargs)

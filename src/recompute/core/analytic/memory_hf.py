"""Activation bytes of one layer of transformers' own classes (a spec read from a config), by component.

Counted tensor by tensor from what autograd saves in each class (transformers 5), and held to the trace of the
real class for every covered architecture (``tests/test_analytic_zoo.py``). Symbols: T = b*s tokens of one
micro-batch, e bytes per activation element, h hidden, q_dim = a*d and kv_dim = k*d, f the MLP width.

- transformers' RMSNorm upcasts: it keeps the fp32 input (4 B), the fp32 rstd per row and the normalised
  rows, cast back to e before the weight (Llama, 4 + e per element) or in fp32 (OLMo 2, Gemma: 4 + 4; Gemma
  also keeps its fp32 (1 + w), 4h per norm). A LayerNorm keeps its input and mean and rstd (fp32 on CUDA,
  the input dtype on the CPU); GPT-NeoX's two parallel LayerNorms share one input;
- SDPA keeps q, k, v, its output and an fp32 log-sum-exp; its output is the output projection's input
  (the same storage) unless the Q/K/V projection is fused and rotary made new contiguous q/k (Phi-3,
  GPT-NeoX). With a sliding window no longer than the sequence SDPA gets an explicit mask (b*s*s, kept by each
  layer) which turns off its grouped-query path: K and V are repeated to all heads. Eager attention repeats
  K and V too, keeps the fp32 softmax and its cast to e (Gemma 2 also the tanh of its soft-capping);
- Note: [core_attn in transformers' classes] recompute checkpoints the class's attention function, which
  keeps its positional inputs: q, k and v before any repeat, and the mask (one storage, the first layer's);
  the output projection's input stays, SDPA's output is replayed;
- an MoE layer (transformers' grouped-matmul experts) keeps the router's fp32 softmax (T x E), the top-k
  indices (int64), the renormalisation's sum and values where the router renormalises, and per routed token
  copy (R = T*k at the expected load, ``Workload.routed_tokens``): the gathered input, the gate/up output (2
  d_expert), silu(gate) and the product, the down output, the routing weight, three int64 indices; and the
  E/ep int32 group offsets.
"""

from __future__ import annotations

from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

__all__ = ["hf_layer_parts", "hf_shared_tables"]

NORMS_PER_LAYER = {"pre": 2, "post": 2, "parallel": 2, "sandwich": 4}


def _norm(spec: ModelSpec, wl: Workload, rows: float, width: int, *, shared_input: bool = False) -> tuple[float, float]:
    """(saved bytes, statistics bytes) of one of transformers' norms over ``rows`` rows of ``width``."""
    e = wl.element_bytes
    if spec.norm == "layernorm":
        stats = 4 if wl.device == "cuda" else e
        return (0.0 if shared_input else e * rows * width), 2 * stats * rows
    normalised = e if spec.norm == "rmsnorm" else 4  # Llama casts back before the weight; OLMo 2 / Gemma do not
    constant = 4 * width if spec.norm == "gemma_rmsnorm" else 0  # Gemma's fp32 (1 + w)
    return (4 + normalised) * rows * width, 4 * rows + constant


def _mlp_tensors(spec: ModelSpec) -> int:
    """d_ff-wide tensors a dense MLP keeps: GELU input and output; GPT-2's written-out tanh GELU five; gated four."""
    return {"gelu": 2, "gelu_new": 5, "swiglu": 4, "geglu": 4}[spec.mlp]


def _eager(spec: ModelSpec, wl: Workload) -> bool:
    return wl.attention == "eager" or spec.eager_only


def _attention(spec: ModelSpec, wl: Workload) -> dict[str, float]:
    """qkv, scores and attn_out of one layer (per tensor-parallel rank)."""
    s, b, a, t, e = wl.seq_len, wl.micro_batch, spec.n_heads, wl.tp, wl.element_bytes
    T, qd, kd = s * b, spec.q_dim, spec.kv_dim
    m = 0 if spec.dropout == 0 else (1 if wl.device == "cuda" else e)
    ass = a * s * s * b / t
    if _eager(spec, wl) and spec.mlp == "gelu_new":  # GPT-2's eager attention: softmax in e, dropout after it
        # At b = 1 the bmm's k^T is a view of the fused c_attn output (b*a merge without a copy), which keeps the
        # whole output alive beside the copies of q and v (as SDPA does at any b); at b > 1 q, k, v are copied.
        fused = wl.micro_batch == 1
        qkv = e * T * ((qd + 2 * kd) + ((qd + kd) if fused else 0)) / t
        return {"qkv": qkv, "scores": (e + (m + e if m else 0)) * ass, "attn_out": e * T * qd / t}
    if _eager(spec, wl):
        softmax = 4 + (e if e != 4 else 0) + (e if spec.attn_softcap else 0)  # fp32 softmax, its cast, tanh
        return {"qkv": 3 * e * T * qd / t, "scores": softmax * ass, "attn_out": e * T * qd / t}
    if m:  # Note: [SDPA with dropout on the CPU] the math path: fp32 copies of q, k, v, softmax, mask, output
        qkv = e * T * (qd + 2 * kd) / t
        return {"qkv": qkv, "scores": (3 * 4 * ass + 4 * T * 3 * qd / t) - qkv, "attn_out": e * T * qd / t}
    windowed = 0 < spec.sliding_window <= s  # transformers masks when kv_length >= the window
    qkv = e * T * (3 * qd if windowed else qd + 2 * kd) / t
    copied = spec.fused_qkv and spec.position == "rotary"  # rotary made contiguous q/k: SDPA's output is copied
    if spec.fused_qkv and spec.position == "learned":  # GPT-2: q/k/v views of the fused output; q and v copied
        qkv = e * T * ((qd + 2 * kd) + (qd + kd)) / t
    if _view_keeps_fused(spec, wl):
        qkv += e * T * (qd + kd)
    mask = b * s * s * e if windowed else 0  # each layer's SDPA keeps its own copy of the mask
    return {"qkv": qkv, "scores": 4 * a * T / t + mask, "attn_out": (2 if copied else 1) * e * T * qd / t}


def _view_keeps_fused(spec: ModelSpec, wl: Workload) -> bool:
    """Without a key/value cache, V reaches SDPA as a view of a fused Q/K/V output (rotary made q and k new), which
    keeps the whole output alive: its q and k parts beside the rotated copies (unless K/V are repeated)."""
    repeated = 0 < spec.sliding_window <= wl.seq_len and spec.n_kv_heads < spec.n_heads
    return not spec.kv_cache and spec.fused_qkv and spec.position == "rotary" and not repeated


def _core_kept(spec: ModelSpec, wl: Workload, layer: int) -> float:
    """What ``core_attn`` keeps of the attention (Note: [core_attn in transformers' classes])."""
    e, T, qd, kd, t = wl.element_bytes, wl.tokens, spec.q_dim, spec.kv_dim, wl.tp
    qkv = e * T * (qd + 2 * kd)
    if spec.fused_qkv and spec.position == "learned":
        qkv += e * T * (qd + kd)  # GPT-2: contiguous copies of q and v beside the fused output
    if _view_keeps_fused(spec, wl):
        qkv += e * T * (qd + kd)  # the checkpoint keeps v, a view of the whole fused output
    masked = _eager(spec, wl) or 0 < spec.sliding_window <= wl.seq_len
    first = layer == 0 or (spec.eager_only and layer == 1)  # Gemma 2: a sliding and a full layer, a mask each
    mask = wl.micro_batch * wl.seq_len**2 * e if masked and first else 0
    return (qkv + e * T * qd) / t + mask


def _qk_norms(spec: ModelSpec, wl: Workload) -> float:
    """Bytes the q/k norms keep: per head (rows T*a and T*k over head_dim) or over all of Q and K (rows T)."""
    T = wl.tokens
    if spec.qk_norm == "":
        return 0.0
    if spec.qk_norm == "head":
        parts = [_norm(spec, wl, T * n, spec.head_dim) for n in (spec.n_heads, spec.n_kv_heads)]
    else:
        parts = [_norm(spec, wl, T, width) for width in (spec.q_dim, spec.kv_dim)]
    return sum(saved + stats for saved, stats in parts) / wl.tp


def _experts(spec: ModelSpec, wl: Workload) -> tuple[float, float]:
    """(router bytes, experts bytes) of an MoE layer on one expert-parallel rank."""
    T, e, E, k = wl.tokens, wl.element_bytes, spec.n_experts, spec.top_k
    router = 4 * T * E + 8 * T * k + ((4 * T + 4 * T * k) if spec.norm_topk else 0)
    R, d = wl.routed_tokens(spec), spec.d_expert
    weight = 4 if spec.fp32_routing else e
    experts = R * (2 * e * spec.hidden + 4 * e * d + weight + 3 * 8) + 4 * E / wl.ep
    return router, experts


def hf_layer_parts(spec: ModelSpec, wl: Workload, layer: int) -> dict[str, float]:
    """``LayerActivations`` fields of layer ``layer`` of transformers' class for ``spec``."""
    T, h, e, t = wl.tokens, spec.hidden, wl.element_bytes, wl.tp
    r = t if wl.sp else 1
    m = 0 if spec.dropout == 0 else (1 if wl.device == "cuda" else e)
    n_norms = NORMS_PER_LAYER[spec.residual]
    first_saved, first_stats = _norm(spec, wl, T, h)
    other_saved, _ = _norm(spec, wl, T, h, shared_input=spec.residual == "parallel")
    if spec.is_moe(layer):
        router, mlp_hidden = _experts(spec, wl)
        workspace = 2 * e * wl.routed_tokens(spec) * 2 * spec.d_expert
    else:
        router, mlp_hidden = 0.0, _mlp_tensors(spec) * e * T * spec.d_ff / t
        workspace = 2 * e * T * spec.d_ff / t
    attention = _attention(spec, wl)
    learned_eager = spec.position == "learned" and _eager(spec, wl) and layer == 0
    return dict(
        core_kept=_core_kept(spec, wl, layer),
        block_extra=wl.micro_batch * wl.seq_len**2 * e if learned_eager else 0.0,
        attn_in=e * T * h / r,
        qk_norm=_qk_norms(spec, wl),
        **attention,
        attn_drop=m * T * h / r,
        mlp_in=e * T * h / r,
        router=router,
        mlp_hidden=mlp_hidden,
        mlp_drop=m * T * h / r,
        norms=(first_saved + (n_norms - 1) * other_saved) / r,
        norm_stats=n_norms * first_stats / r,
        layer_in=e * T * h / r,
        workspace=max(workspace, 2 * e * T * h, 2 * attention["scores"] if _eager(spec, wl) else 0.0),
    )


def hf_shared_tables(spec: ModelSpec, wl: Workload) -> float:
    """Tensors every layer reads but the first saves (one storage): rotary cos and sin."""
    e, s = wl.element_bytes, wl.seq_len
    rope_bytes = 4 if spec.norm == "rmsnorm_fp32" else e  # OLMo 2 applies its rotary in fp32
    rope = 2 * s * spec.rotary_dim * rope_bytes if spec.position == "rotary" else 0
    return rope

"""Llama, written for clarity (after meta-llama/llama and pytorch-labs/gpt-fast).

RMSNorm (``F.rms_norm``), a SwiGLU MLP, grouped-query attention and rotary position embeddings; dropout
only where the spec asks for it (the Llama presets have none). Eager attention never materialises repeated
K/V: query heads of one KV group are folded into the sequence (``recompute.models.core``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recompute.core.errors import one_of
from recompute.core.spec import ModelSpec
from recompute.core.workload import ATTENTIONS
from recompute.models.core import LanguageModel, causal_attention

__all__ = ["GroupedQueryAttention", "Llama", "SwiGLU", "apply_rotary", "rope_tables"]


def rope_tables(s: int, dh: int, theta: float, *, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles for positions 0..s-1, each (s, dh), computed in fp32 then cast.

    Built once per forward from ``theta`` (no position table to store or save: two (s, dh) tensors that
    every layer shares).
    """
    inv_freq = theta ** (-torch.arange(0, dh, 2, device=device, dtype=torch.float32) / dh)  # (dh/2,)
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)  # (s, dh/2)
    angles = torch.cat((angles, angles), dim=-1)  # (s, dh), Hugging Face's half-split layout
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., s, dh) by the angles; saves only ``cos`` and ``sin`` (they need no gradient)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with n_kv_heads key/value heads shared by groups of query heads, and RoPE."""

    def __init__(self, spec: ModelSpec, *, attention: str = "flash") -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.wq = nn.Linear(spec.hidden, spec.q_dim, bias=spec.bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wo = nn.Linear(spec.q_dim, spec.hidden, bias=spec.bias)
        self.resid_dropout = nn.Dropout(spec.dropout)
        self.dropout = spec.dropout
        self.attention = one_of("attention", attention, ATTENTIONS)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        b, s, _ = q.shape  # not x's: with sequence parallelism x holds only this rank's share of the sequence
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, a, s, dh)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, dh)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, dh)
        y = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, a*dh), a copy that wo saves
        return self.resid_dropout(self.wo(y))

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The Q, K and V projections of ``x``, (b, s, a*dh) and twice (b, s, kv*dh); saved: x, once."""
        return self.wq(x), self.wk(x), self.wv(x)

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Core attention over unexpanded K/V (eager) or SDPA with ``enable_gqa``; (b, a, s, dh)."""
        return causal_attention(q, k, v, impl=self.attention, dropout_p=self.dropout if self.training else 0.0)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; saves x, the gate and up projections, silu(gate) and the product."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(spec.hidden, spec.d_ff, bias=spec.bias)  # gate
        self.w3 = nn.Linear(spec.hidden, spec.d_ff, bias=spec.bias)  # up
        self.w2 = nn.Linear(spec.d_ff, spec.hidden, bias=spec.bias)  # down
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.dropout(self.w2(F.silu(gate) * up))

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up projections of ``x``, each (b, s, d_ff); saved: x, once."""
        return self.w1(x), self.w3(x)


class Llama(LanguageModel):
    """Llama language model built from a ``ModelSpec`` (``spec.mlp == "swiglu"``): the shell's layers
    (``LanguageModel``), every one taking the rotary tables ``(cos, sin)`` built once per forward."""

    def __init__(self, spec: ModelSpec, *, attention: str = "flash") -> None:
        super().__init__(spec, attn=lambda: GroupedQueryAttention(spec, attention=attention), mlp=lambda: SwiGLU(spec))

    def positions(self, x: Tensor, s: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        x = self.drop(x)
        return x, rope_tables(s, self.spec.head_dim, self.spec.rope_theta, device=x.device, dtype=x.dtype)

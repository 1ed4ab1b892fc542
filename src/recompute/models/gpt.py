"""GPT-2, written for clarity in the spirit of nanoGPT (karpathy/nanoGPT model.py).

LayerNorm, a GELU MLP, dropout on embeddings, attention probabilities and both residual branches, learned
positions and tied embeddings. With ``attention="eager"`` one layer saves exactly what Korthikanti et al.
2022 count (``recompute.core.analytic.layer_activations``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recompute.core.errors import one_of
from recompute.core.spec import ModelSpec
from recompute.core.workload import ATTENTIONS
from recompute.models.core import LanguageModel, causal_attention

__all__ = ["GPT", "CausalSelfAttention", "GeluMLP"]


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with one fused Q/K/V projection."""

    def __init__(self, spec: ModelSpec, *, attention: str = "flash") -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.split = (spec.q_dim, spec.kv_dim, spec.kv_dim)
        self.c_attn = nn.Linear(spec.hidden, sum(self.split), bias=spec.bias)
        self.c_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.bias)
        self.resid_dropout = nn.Dropout(spec.dropout)
        self.dropout = spec.dropout
        self.attention = one_of("attention", attention, ATTENTIONS)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        b, s, _ = q.shape  # not x's: with sequence parallelism x holds only this rank's share of the sequence
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, a, s, dh)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, dh)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, dh)
        y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, a*dh), a copy that c_proj saves
        return self.resid_dropout(self.c_proj(y))

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V of ``x`` from one fused matmul, each (b, s, heads*dh); saved: x, the c_attn input."""
        q, k, v = self.c_attn(x).split(self.split, dim=2)
        return q, k, v

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Core attention: QK^T, softmax, dropout, attention over V (or the SDPA call); (b, a, s, dh)."""
        return causal_attention(q, k, v, impl=self.attention, dropout_p=self.dropout if self.training else 0.0)


class GeluMLP(nn.Module):
    """fc -> GELU -> proj -> dropout; saves the fc input, the GELU input and output, the dropout mask."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden, spec.d_ff, bias=spec.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(spec.d_ff, spec.hidden, bias=spec.bias)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPT(LanguageModel):
    """GPT-2 language model built from a ``ModelSpec`` (``spec.mlp == "gelu"``): learned positions added to the
    token embeddings, then the shell's layers (``LanguageModel``)."""

    positions_word = "learned positions"

    def __init__(self, spec: ModelSpec, *, attention: str = "flash") -> None:
        super().__init__(spec, attn=lambda: CausalSelfAttention(spec, attention=attention), mlp=lambda: GeluMLP(spec))

    def add_positions(self, spec: ModelSpec) -> None:
        self.pos_emb = nn.Embedding(spec.max_positions, spec.hidden)

    def positions(self, x: Tensor, s: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        pos = torch.arange(s, device=x.device)
        return self.drop(x + self.pos_emb(pos)), ()

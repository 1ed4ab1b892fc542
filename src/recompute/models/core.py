"""Pieces both reference models share: core attention (eager math or SDPA), the pre-norm block, the loss, and the
language-model shell around the layers (``LanguageModel``).

What autograd saves here is what ``recompute.core.analytic.memory`` counts, tensor for tensor, so the analytic
model can be checked against these modules (see tests/test_apply_memory.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recompute.core.spec import ModelSpec

__all__ = ["Block", "LanguageModel", "causal_attention", "cross_entropy", "init_weights", "make_norm"]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, impl: str, dropout_p: float) -> Tensor:
    """Causal attention of ``q`` over ``k``/``v``; the core that the ``core_attn`` policy recomputes.

    Args:
        q: queries, (b, a, s, dh).
        k, v: keys and values, (b, kv, s, dh) with kv dividing a (query head j reads KV head j // (a / kv)).
        impl: ``eager`` or ``flash``.
        dropout_p: dropout on the attention probabilities (pass 0.0 outside training).

    Returns:
        The attention output, (b, a, s, dh).
    """
    if impl == "flash":
        gqa = k.size(1) != q.size(1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    return _eager_attention(q, k, v, dropout_p)


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    b, a, s, dh = q.shape
    kv = k.size(1)
    g = a // kv
    # Note: [GQA without repeating K/V] the g query heads that share one KV head are folded into the
    # sequence dimension, so the matmuls read the unexpanded K and V and autograd saves them at kv_dim.
    q = q.reshape(b, kv, g * s, dh)  # (b, kv, g*s, dh)
    att = q @ k.transpose(-2, -1)  # (b, kv, g*s, s); the matmul saves q and k, not its output
    # In place: a fresh s^2 buffer per op costs the CPU allocator more than the op itself (page faults), and
    # the recompute replays these lines. Adding a -inf bias saves nothing (masked_fill would save the mask).
    att.mul_(1.0 / math.sqrt(dh)).add_(_causal_bias(s, g, att.dtype, att.device))
    att = F.softmax(att, dim=-1)  # saved: (b, a, s, s) in the activation dtype
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p, training=True)  # saved: its mask, and its output for att @ v
    y = att @ v  # (b, kv, g*s, dh)
    return y.view(b, a, s, dh)


def _causal_bias(s: int, g: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive causal mask for g query groups stacked along the rows: (g*s, s), -inf above the diagonal."""
    return torch.full((s, s), float("-inf"), dtype=dtype, device=device).triu(1).repeat(g, 1)


class Block(nn.Module):
    """A pre-norm transformer layer: ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``.

    Extra positional arguments (Llama's rotary tables) go to ``attn``. Dropout on the residual branches lives
    inside ``attn`` and ``mlp``, so recomputing a sub-block replays its masks too.
    """

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: Tensor, *extra: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), *extra)
        return x + self.mlp(self.norm2(x))


def cross_entropy(logits: Tensor, targets: Tensor, *, reduction: str = "mean") -> Tensor:
    """fp32 cross-entropy over all positions: the reference models' loss (``model.loss_fn``).

    Targets of -100 count for nothing (``F.cross_entropy``'s ``ignore_index``); ``reduction="sum"`` gives the
    sum over the others, which the chunked loss (``recompute.chunked_loss``) adds up over its chunks.
    ``recompute.parallel.parallelize`` replaces ``model.loss_fn`` by Megatron's vocabulary-parallel
    cross-entropy, which takes the vocabulary-sharded logits without gathering them.
    """
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)


def init_weights(module: nn.Module, *, n_layers: int) -> None:
    """GPT-2 initialisation (nanoGPT): N(0, 0.02), zero biases, output projections scaled by 1/sqrt(2L)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue  # norms keep ones/zeros, biases are zeroed below
        std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("c_proj.weight", "wo.weight", "w2.weight")) else 0.02
        nn.init.normal_(p, mean=0.0, std=std)
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def make_norm(spec: ModelSpec) -> nn.Module:
    """The spec's norm: LayerNorm (input, fp32 mean and rstd saved) or RMSNorm (``F.rms_norm``)."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps, bias=spec.bias)
    return nn.RMSNorm(spec.hidden, eps=spec.norm_eps)


class LanguageModel(nn.Module):
    """The shell of recompute's reference models: token embedding, dropout, the pre-norm layers, the final norm,
    the output layer and the loss; GPT and Llama differ in their layers' attention and MLP and in how they mark
    positions (``add_positions``, ``positions``).

    ``forward(idx, targets=None) -> (logits, loss_or_None)``; ``layers`` holds the blocks, each with ``norm1``,
    ``attn``, ``norm2``, ``mlp``.
    """

    positions_word = "positions"
    """How the too-long-sequence error names the model's positions."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        attn: Callable[[], nn.Module],
        mlp: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab, spec.hidden)
        self.add_positions(spec)  # before the rest: the modules' order is the order weights are drawn in
        self.drop = nn.Dropout(spec.dropout)
        self.layers = nn.ModuleList(
            Block(make_norm(spec), attn(), make_norm(spec), mlp()) for _ in range(spec.n_layers)
        )
        self.norm = make_norm(spec)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy  # parallelize swaps it
        init_weights(self, n_layers=spec.n_layers)
        if spec.tied_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying, as GPT-2 does

    def add_positions(self, spec: ModelSpec) -> None:
        """Register what marks positions (learned embeddings); none by default."""

    def positions(self, x: Tensor, s: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The embedded tokens with positions marked, and what every layer takes besides (rotary tables)."""
        return self.drop(x), ()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (b, s, v) for token ids ``idx`` (b, s), and the cross-entropy against ``targets``."""
        s = idx.size(1)
        if s > self.spec.max_positions:
            limit = self.spec.max_positions
            raise ValueError(f"sequence of {s} tokens exceeds the model's {limit} {self.positions_word}")
        x, extra = self.positions(self.tok_emb(idx), s)  # (b, s, h)
        for layer in self.layers:
            x = layer(x, *extra)
        del extra  # the loss needs no rotary tables
        x = self.norm(x)  # the residual stream dies here unless the norm keeps it
        logits = self.lm_head(x)  # (b, s, v)
        return logits, None if targets is None else self.loss_fn(logits, targets)

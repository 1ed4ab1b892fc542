"""Megatron's tensor- and sequence-parallel operators on local shards, as autograd Functions.

Each works on this rank's local tensors (the ``to_local()`` of DTensor parameters) and talks to the other
ranks through DTensor redistributions, so it runs wherever DTensor does: gloo on the CPU, NCCL on CUDA, and
the fake process group under ``FakeTensorMode``. Tensors are batch-first, (b, s, h): the sequence is dim 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from recompute.core.errors import one_of

__all__ = ["column_parallel", "scatter_sequence", "vocab_parallel_cross_entropy", "vocab_parallel_embedding"]

SEQ = 1
"""The sequence dimension of (b, s, h) activations."""

IGNORE_INDEX = -100
"""Targets that count for nothing in the loss (``F.cross_entropy``'s default ``ignore_index``)."""


def _redistribute(x: Tensor, mesh: DeviceMesh, src: Placement, dst: Placement) -> Tensor:
    """This rank's part of ``x`` laid out as ``dst``, given that ranks hold it as ``src`` (no autograd)."""
    out = DTensor.from_local(x, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


def _all_gather(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """(b, s/t, h) sequence shards -> the whole (b, s, h) on every rank."""
    return _redistribute(x, mesh, Shard(SEQ), Replicate())


def _reduce_scatter(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """(b, s, h) partial sums -> this rank's (b, s/t, h) shard of their sum."""
    return _redistribute(x, mesh, Partial(), Shard(SEQ))


def _all_reduce(x: Tensor, mesh: DeviceMesh, op: str = "sum") -> Tensor:
    return _redistribute(x, mesh, Partial(op), Replicate())


class _ColumnParallelLinears(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for this rank's rows of each W_i (Megatron's ColumnParallelLinear).

    Note: [save the shard, gather twice] with sequence parallelism ``x`` is this rank's sequence shard. It is
    all-gathered for the matmuls and again in the backward for the weight gradients, so only the shard is
    saved: sbh/t, where a DTensor all-gather before the linear would save the gathered sbh (Korthikanti et
    al. 2022, Sec. 4.2.2). The input gradient is reduce-scattered back to the shard. Without sequence
    parallelism ``x`` is replicated and its gradient all-reduced (Megatron's ``f``). Several weights reading
    one input (Q, K, V; gate and up) share the gather, the saved input and the reduction of its gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: DeviceMesh, sp: bool, n: int, *params: Tensor | None) -> tuple[Tensor, ...]:
        weights, biases = [w for w in params[:n] if w is not None], params[n:]
        full = _all_gather(x, mesh) if sp else x  # (b, s, h)
        ctx.save_for_backward(x, *weights)
        ctx.mesh, ctx.sp, ctx.has_bias = mesh, sp, [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))  # each (b, s, out/t)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        full = _all_gather(x, ctx.mesh) if ctx.sp else x  # gathered again: only the shard was kept
        grad_x = None
        if ctx.needs_input_grad[0]:
            partial = sum(g @ w for g, w in zip(grads, weights))  # (b, s, h): this rank's columns only
            grad_x = _reduce_scatter(partial, ctx.mesh) if ctx.sp else _all_reduce(partial, ctx.mesh)
        flat = full.reshape(-1, full.size(-1))  # (b*s, h)
        flat_grads = [g.reshape(-1, g.size(-1)) for g in grads]  # (b*s, out/t)
        n = len(weights)
        grad_w = [g.t() @ flat if ctx.needs_input_grad[4 + i] else None for i, g in enumerate(flat_grads)]
        grad_b = [
            g.sum(0) if has and ctx.needs_input_grad[4 + n + i] else None
            for i, (g, has) in enumerate(zip(flat_grads, ctx.has_bias))
        ]
        return grad_x, None, None, None, *grad_w, *grad_b


def column_parallel(x: Tensor, linears: list[nn.Linear], mesh: DeviceMesh, *, sp: bool) -> tuple[Tensor, ...]:
    """The outputs of column-parallel ``linears`` (weights DTensors sharded by rows) for one input ``x``.

    Args:
        x: (b, s/t, h), this rank's sequence shard, with ``sp``; else (b, s, h), the same on every rank.
        linears: ``nn.Linear``s whose weight (and bias) are ``Shard(0)`` DTensors on ``mesh``.
        mesh: the 1-D tensor-parallel mesh.
        sp: whether ``x`` is sequence-sharded (gathered here, saved as the shard).

    Returns:
        One local (b, s, out/t) tensor per linear.
    """
    weights = [_local(m.weight) for m in linears]
    biases = [_local(m.bias) if m.bias is not None else None for m in linears]
    return _ColumnParallelLinears.apply(x, mesh, sp, len(linears), *weights, *biases)


def _local(p: Tensor) -> Tensor:
    """A DTensor parameter's local shard, differentiably (the gradient comes back as a DTensor)."""
    return p.to_local() if isinstance(p, DTensor) else p


class _ScatterSequence(torch.autograd.Function):
    """Keep this rank's s/t positions of a replicated (b, s, h) tensor; the backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: DeviceMesh) -> Tensor:
        ctx.mesh = mesh
        shard = x.chunk(mesh.size(), dim=SEQ)[mesh.get_local_rank()]
        # A copy, not a view: the next layer saves it, and a view would keep the whole sequence alive.
        return shard.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_gather(grad.contiguous(), ctx.mesh), None


def scatter_sequence(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """This rank's (b, s/t, h) shard of ``x`` (b, s, h), which every rank holds whole; a fresh tensor."""
    return _ScatterSequence.apply(x, mesh)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits sharded over the vocabulary, without gathering them (Megatron).

    Targets of -100 count for nothing, as in ``F.cross_entropy``: the mean is over the others (``reduction``
    ``sum``: their sum). Saves the fp32 softmax of this rank's vocabulary slice, (N, v/t): the 4sbv/t the
    analytic model counts.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, start: int, mesh: DeviceMesh, reduction: str) -> Tensor:
        v_local = logits.size(-1)  # logits: (b*s, v/t), fp32
        z = logits - _all_reduce(logits.amax(dim=-1), mesh, "max").unsqueeze(-1)  # a fresh (N, v/t) buffer
        local = targets - start
        mine = (local >= 0) & (local < v_local)  # this rank holds the target's logit (never an ignored target's)
        local = local.clamp(0, max(v_local - 1, 0))
        target_z = _all_reduce(z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine, mesh)  # (N,)
        probs = z.exp_()
        total = _all_reduce(probs.sum(dim=-1), mesh)  # (N,): the softmax denominator over all ranks
        valid = targets != IGNORE_INDEX
        # An ignored row's softmax becomes zeros, so its gradient is zero without saving which rows they are.
        probs.div_(torch.where(valid, total, torch.inf).unsqueeze(-1))
        ctx.save_for_backward(probs, local, mine)
        ctx.count = valid.sum() if reduction == "mean" else None
        loss = torch.where(valid, total.log() - target_z, 0.0).sum()
        return loss / ctx.count if ctx.count is not None else loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        probs, local, mine = ctx.saved_tensors
        scale = grad / ctx.count if ctx.count is not None else grad
        grad_logits = probs * scale  # softmax minus the one-hot target, over the count for the mean
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), (-scale * mine.to(probs.dtype)).unsqueeze(-1))
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, targets: Tensor, *, reduction: str = "mean") -> Tensor:
    """fp32 cross-entropy of ``logits`` (b, s, v), a DTensor sharded on the vocabulary, vs ``targets`` (b, s).

    The mean over the targets that are not -100 (``reduction="sum"``: their sum), as ``F.cross_entropy``.
    Every tensor-parallel rank returns the same loss; ``targets`` are the whole (replicated) token ids.
    """
    one_of("reduction", reduction, ("mean", "sum"))
    mesh = logits.device_mesh
    v, t = logits.shape[-1], mesh.size()
    start = min(mesh.get_local_rank() * -(-v // t), v)  # Shard(-1) splits like torch.chunk: ceil(v/t) per rank
    local = logits.to_local().float()
    flat = local.reshape(-1, local.size(-1))
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), start, mesh, reduction)


class _VocabParallelEmbedding(torch.autograd.Function):
    """Look up token ids in this rank's rows of the table, zero the others, all-reduce (Megatron).

    The weight gradient is built on this rank's (v/t, h) rows only: DTensor's row-wise embedding builds the
    whole (v, h) gradient on every rank in the backward and slices it (1 GiB per rank for Llama 3.1 8B).
    Saves the local ids (int64) and which of them this rank holds (bool).
    """

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor, start: int, mesh: DeviceMesh) -> Tensor:
        rows = weight.size(0)
        local = ids - start
        mine = (local >= 0) & (local < rows)
        local = local.clamp(0, max(rows - 1, 0))
        ctx.save_for_backward(local, mine)
        ctx.rows = rows
        out = F.embedding(local, weight) * mine.unsqueeze(-1).to(weight.dtype)  # (b, s, h), this rank's share
        return _all_reduce(out, mesh)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        local, mine = ctx.saved_tensors
        h = grad.size(-1)
        g = (grad * mine.unsqueeze(-1).to(grad.dtype)).reshape(-1, h)  # the gradient is the same on every rank
        grad_w = torch.zeros(ctx.rows, h, dtype=grad.dtype, device=grad.device)
        return None, grad_w.index_add_(0, local.reshape(-1), g), None, None


def vocab_parallel_embedding(ids: Tensor, weight: DTensor) -> Tensor:
    """Embeddings (b, s, h), the same on every rank, of token ids (b, s) in a table sharded by vocabulary rows."""
    mesh = weight.device_mesh
    v, t = weight.shape[0], mesh.size()
    start = min(mesh.get_local_rank() * -(-v // t), v)  # Shard(0) splits like torch.chunk
    return _VocabParallelEmbedding.apply(ids, weight.to_local(), start, mesh)

"""Parameter counts and model-state bytes (parameters, gradients, optimizer) by precision mode.

Counts follow the modules recompute builds and transformers' classes (held to ``num_parameters()`` of each
covered architecture, built on the meta device): biases and LayerNorm shifts only where ``spec.bias``, Q/K/V
biases where ``spec.qkv_bias``, q/k norm weights, two to four norms per layer (``spec.residual``), and an MoE
layer's router (E x h) and E experts of three (h x d_expert) matrices. With expert parallelism over ep ranks a
rank holds E/ep experts. Bytes per parameter follow Megatron-LM's theoretical_memory_usage.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

__all__ = [
    "LayerParams",
    "ModelStates",
    "active_params",
    "bytes_per_param",
    "layer_params",
    "model_states",
    "n_params",
    "norm_params",
]


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, split by whether tensor parallelism shards them."""

    sharded: int
    """Weights of the column/row-parallel linears and the column-parallel biases (divided by t)."""
    replicated: int
    """Norm weights/shifts and the row-parallel output biases (kept whole on every tensor-parallel rank)."""
    experts: int = 0
    """Weights of the routed experts (divided by ep, and by t as Megatron's expert tensor parallelism does)."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def per_rank(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters one rank holds with tensor parallelism t and expert parallelism ep."""
        return self.sharded // tp + self.replicated + self.experts // (ep * tp)


def norm_params(spec: ModelSpec) -> int:
    """Parameters of one norm: a weight, and a shift for a LayerNorm with biases."""
    return 2 * spec.hidden if spec.norm == "layernorm" and spec.bias else spec.hidden


NORMS_PER_LAYER = {"pre": 2, "post": 2, "parallel": 2, "sandwich": 4}
"""Norms of one layer by where they sit (Gemma 2's sandwich: before and after each sub-block)."""


def qk_norm_params(spec: ModelSpec) -> int:
    """Weights of the q/k norms: one head_dim each (per head, Qwen3), or all of Q and K (OLMo 2)."""
    return {"": 0, "head": 2 * spec.head_dim, "full": spec.q_dim + spec.kv_dim}[spec.qk_norm]


def layer_params(spec: ModelSpec, layer: int = 0) -> LayerParams:
    """Parameters of layer ``layer``: attention (Q, K, V, output), the MLP or the experts and router, norms."""
    h, f = spec.hidden, spec.d_ff
    qkv_width = spec.q_dim + 2 * spec.kv_dim
    qkv = h * qkv_width + (qkv_width if spec.qkv_bias or spec.bias else 0)
    out = spec.q_dim * h
    norms = NORMS_PER_LAYER[spec.residual] * norm_params(spec) + qk_norm_params(spec)
    row_bias = 2 * h if spec.bias else 0
    if spec.is_moe(layer):
        router = spec.n_experts * h
        experts = spec.n_experts * 3 * h * spec.d_expert
        return LayerParams(sharded=qkv + out, replicated=norms + router, experts=experts)
    mlp = (3 if spec.gated else 2) * h * f + (((2 if spec.gated else 1) * f) if spec.bias else 0)
    return LayerParams(sharded=qkv + out + mlp, replicated=norms + row_bias)


def embedding_params(spec: ModelSpec) -> int:
    """Token (and learned position) embeddings."""
    return spec.vocab * spec.hidden + (spec.max_positions * spec.hidden if spec.position == "learned" else 0)


def head_params(spec: ModelSpec) -> int:
    """Final norm and, when untied, the output projection."""
    return norm_params(spec) + (0 if spec.tied_embeddings else spec.vocab * spec.hidden)


def n_params(spec: ModelSpec) -> int:
    """Total parameters of the model (tied embeddings counted once): transformers' ``num_parameters()``."""
    layers = sum(layer_params(spec, i).total for i in range(spec.n_layers))
    return layers + embedding_params(spec) + head_params(spec)


def active_params(spec: ModelSpec) -> int:
    """Parameters one token passes through: an MoE layer counts its top-k experts, not all E."""
    total = n_params(spec)
    for i in range(spec.n_layers):
        if spec.is_moe(i):
            total -= (spec.n_experts - spec.top_k) * 3 * spec.hidden * spec.d_expert
    return total


def bytes_per_param(precision: str, dp: int = 1, *, fsdp: bool = False) -> dict[str, float]:
    """Bytes per parameter for weights, gradients and optimizer state in a precision mode.

    fp32: 4 + 4 + 8 (the workshop); mixed: 2 + 4 + (4 master + 8 Adam) (Megatron, 18 B); distributed:
    mixed with master weights and Adam sharded over d ranks, 6 + 12/d; bf16: 2 + 2 + 4; amp (autocast over fp32
    weights): 4 + 4 + 8, its casts of the weights being activations. ``fsdp`` (full shard over ``dp`` ranks):
    all three sharded, in the parameters' dtype (fp32 shards under mixed and amp, FSDP's mixed precision; bf16
    under bf16): (4 + 4 + 8)/d or (2 + 2 + 4)/d.
    """
    if fsdp:
        w = 2.0 if precision == "bf16" else 4.0
        return {"parameters": w / dp, "gradients": w / dp, "optimizer": 2 * w / dp}
    table = {
        "fp32": (4.0, 4.0, 8.0),
        "amp": (4.0, 4.0, 8.0),
        "mixed": (2.0, 4.0, 12.0),
        "distributed": (2.0, 4.0, 12.0 / dp),
        "bf16": (2.0, 2.0, 4.0),
    }
    weights, grads, optim = table[precision]
    return {"parameters": weights, "gradients": grads, "optimizer": optim}


@dataclass(frozen=True)
class ModelStates:
    """Parameter, gradient and optimizer bytes on the most-loaded rank (first pipeline stage)."""

    params: int
    """Parameters held by that rank."""
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def stage_params(spec: ModelSpec, wl: Workload) -> int:
    """Parameters on the first pipeline stage of one tensor-parallel rank.

    Follows Megatron: the first stage holds ceil(L/p) layers and the embeddings; with p = 1 it also holds
    the final norm and the output layer. Linear weights divide by t; norms and row-parallel biases do not.
    """
    layers = -(-spec.n_layers // wl.pp)
    held = sum(layer_params(spec, i).per_rank(wl.tp, wl.ep) for i in range(layers))
    count = held + embedding_params(spec) // wl.tp
    if wl.pp == 1:
        untied = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
        count += untied // wl.tp + norm_params(spec)
    return count


def model_states(spec: ModelSpec, wl: Workload) -> ModelStates:
    """Parameter, gradient and optimizer bytes of the first pipeline stage, per rank."""
    params = stage_params(spec, wl)
    per = bytes_per_param(str(wl.precision), wl.dp, fsdp=wl.fsdp)
    return ModelStates(
        params=params,
        parameters=params * per["parameters"],
        gradients=params * per["gradients"],
        optimizer=params * per["optimizer"],
    )

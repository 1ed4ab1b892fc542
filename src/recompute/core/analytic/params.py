"""Parameter counts and model-state bytes (parameters, gradients, optimizer) by precision mode.

Counts follow the modules recompute builds (and Hugging Face's GPT-2 / Llama): biases and LayerNorm shifts
only where ``spec.bias``. Bytes per parameter follow Megatron-LM's theoretical_memory_usage.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute.core.spec import ModelSpec
from recompute.core.workload import Workload

__all__ = [
    "LayerParams",
    "ModelStates",
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

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def norm_params(spec: ModelSpec) -> int:
    """Parameters of one norm: a weight, and a shift for a LayerNorm with biases."""
    return 2 * spec.hidden if spec.norm == "layernorm" and spec.bias else spec.hidden


def layer_params(spec: ModelSpec) -> LayerParams:
    """Parameters of one layer: attention (Q, K, V, output), MLP, two norms."""
    h, f = spec.hidden, spec.d_ff
    qkv = h * (spec.q_dim + 2 * spec.kv_dim)
    out = spec.q_dim * h
    mlp = (3 if spec.mlp == "swiglu" else 2) * h * f
    col_bias = (spec.q_dim + 2 * spec.kv_dim + (2 if spec.mlp == "swiglu" else 1) * f) if spec.bias else 0
    row_bias = 2 * h if spec.bias else 0
    return LayerParams(sharded=qkv + out + mlp + col_bias, replicated=2 * norm_params(spec) + row_bias)


def embedding_params(spec: ModelSpec) -> int:
    """Token (and learned position) embeddings."""
    return spec.vocab * spec.hidden + (spec.max_positions * spec.hidden if spec.position == "learned" else 0)


def head_params(spec: ModelSpec) -> int:
    """Final norm and, when untied, the output projection."""
    return norm_params(spec) + (0 if spec.tied_embeddings else spec.vocab * spec.hidden)


def n_params(spec: ModelSpec) -> int:
    """Total parameters of the model (tied embeddings counted once)."""
    return spec.n_layers * layer_params(spec).total + embedding_params(spec) + head_params(spec)


def bytes_per_param(precision: str, dp: int = 1) -> dict[str, float]:
    """Bytes per parameter for weights, gradients and optimizer state in a precision mode.

    fp32: 4 + 4 + 8 (the workshop); mixed: 2 + 4 + (4 master + 8 Adam) (Megatron, 18 B); distributed:
    mixed with master weights and Adam sharded over d ranks, 6 + 12/d; bf16: 2 + 2 + 4.
    """
    table = {
        "fp32": (4.0, 4.0, 8.0),
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
    lp = layer_params(spec)
    count = layers * (lp.sharded // wl.tp + lp.replicated) + embedding_params(spec) // wl.tp
    if wl.pp == 1:
        untied = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
        count += untied // wl.tp + norm_params(spec)
    return count


def model_states(spec: ModelSpec, wl: Workload) -> ModelStates:
    """Parameter, gradient and optimizer bytes of the first pipeline stage, per rank."""
    params = stage_params(spec, wl)
    per = bytes_per_param(str(wl.precision), wl.dp)
    return ModelStates(
        params=params,
        parameters=params * per["parameters"],
        gradients=params * per["gradients"],
        optimizer=params * per["optimizer"],
    )

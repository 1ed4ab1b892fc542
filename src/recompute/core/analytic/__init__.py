"""The analytic model: closed-form memory and FLOPs, standard library only (no torch import)."""

from recompute.core.analytic.estimate import Estimate, estimate, estimate_policies, in_flight, layer_overheads
from recompute.core.analytic.flops import (
    LayerFlops,
    hardware_flops,
    layer_flops,
    logits_flops,
    mfu,
    model_flops,
    overhead_from_flops,
    paper_hardware_flops_full,
    paper_hardware_flops_selective,
    paper_model_flops,
    recompute_flops,
)
from recompute.core.analytic.memory import (
    LayerActivations,
    OuterActivations,
    layer_activations,
    outer_activations,
    paper_layer_bytes,
)
from recompute.core.analytic.params import ModelStates, bytes_per_param, layer_params, model_states, n_params

__all__ = [
    "Estimate",
    "LayerActivations",
    "LayerFlops",
    "ModelStates",
    "OuterActivations",
    "bytes_per_param",
    "estimate",
    "estimate_policies",
    "hardware_flops",
    "in_flight",
    "layer_activations",
    "layer_flops",
    "layer_overheads",
    "layer_params",
    "logits_flops",
    "mfu",
    "model_flops",
    "model_states",
    "n_params",
    "outer_activations",
    "overhead_from_flops",
    "paper_hardware_flops_full",
    "paper_hardware_flops_selective",
    "paper_layer_bytes",
    "paper_model_flops",
    "recompute_flops",
]

"""``PhaseFlops``: every op's FLOPs by PyTorch's own formulas (``FlopCounterMode``'s table), filed under the
phase of the step.

Not ``FlopCounterMode`` itself, for two reasons. It files FLOPs under the modules running, which misses a
checkpoint's replay (the replayed ops run inside the backward, and the layer's own forward hook does not fire
again); the phase the ``StepTracker`` knows (forward or backward of layer j, of the head, ...) does not: a
layer's replay is part of its backward phase, so a policy's recompute FLOPs in layer j are its backward FLOPs
there minus ``none``'s. And it decomposes every op it has no formula for, which changes what the step
allocates (90 KiB more in a tiny Llama's layer backward); this mode only counts, so the bytes measured in the
same step stay those of the real one.

PyTorch's formula table has no entry for two ops a CPU step runs; they are added here with the same
conventions (2 FLOPs per multiply-add; attention counted as if no mask, as PyTorch counts SDPA):
``_scaled_dot_product_flash_attention_for_cpu`` (SDPA's CPU kernel, forward and backward) and
``_grouped_mm`` (transformers' MoE experts).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from recompute.trace._tracker import Phase, StepTracker

__all__ = ["PhaseFlops"]

aten = torch.ops.aten


def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _sdpa_cpu_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


def _grouped_mm(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """(m, k) x (g, k, n) -> (m, n), each row by one group: 2mkn; (k, m) x (m, n) by groups of m -> (g, k, n):
    2kmn; (g, m, k) x (g, k, n): 2gmkn."""
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_sdpa_cpu),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_sdpa_cpu_backward),
    aten._grouped_mm: shape_wrapper(_grouped_mm),
}


class PhaseFlops(TorchDispatchMode):
    """FLOPs by phase of the step and by op: ``by_phase[Phase][op name]``."""

    def __init__(self, tracker: StepTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.by_phase: dict[Phase, Counter[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            if flops:
                name = str(func._overloadpacket).removeprefix("aten.")
                self.by_phase.setdefault(self.tracker.phase(), Counter())[name] += flops
        return out

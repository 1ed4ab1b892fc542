"""FSDP2 full shard on one rank: what it gathers, and when, on top of the one-device step. Torch-free.

``--fsdp`` over d ranks (``fully_shard`` on each transformer layer, then on the root: the embeddings, the final
norm and the output layer; ``reshard_after_forward``, FSDP2's implicit prefetch). Each rank keeps 1/d of the
parameters, the gradients and the optimizer state (``bytes_per_param(..., fsdp=True)``); the activations are
the one-device step's. What FSDP adds is transient (Note: [what FSDP holds], measured on fake and real gloo
ranks, docs/fsdp.md):

- forward of layer j: the root's parameters, gathered all step, and layer j's twice (its unsharded parameters
  and the flat all-gather output they were copied out of, kept until the next group's copy-out);
- the loss (the head's forward): the root's;
- backward of layer j: the root's and layer j's, layer j - 1's prefetched all-gather output, layer j + 1's
  reduce-scatter input (held until layer j's reduce-scatter, in the reduce dtype), and the root's unsharded
  gradients that the head's backward made (reduced only at the end of the backward); layer j's own unsharded
  gradients come after the peak of its backward, as a one-device layer's do;
- the embedding's backward: the root's parameters and all their gradients, and its reduce-scatter input.

w is the bytes of a gathered element (the parameters' dtype; the compute dtype under FSDP's mixed precision,
``Workload.mixed_policy``), r of a reduce-scatter element (``gathered_bytes``). Padding (each
parameter's first dimension rounded up to a multiple of d) is left out: at most d - 1 rows per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recompute.core.analytic.params import embedding_params, head_params, layer_params, norm_params
from recompute.core.spec import ModelSpec
from recompute.core.workload import DTYPE_BYTES, Workload

__all__ = ["Gathered", "gathered", "gathered_bytes"]


def gathered_bytes(wl: Workload) -> tuple[int, int]:
    """(w, r): bytes of a gathered parameter element and of a reduce-scatter element under ``wl``: the mixed
    policy gathers in the dtype, and reduces in fp32 under ``mixed`` (torchtitan's) and in the dtype under
    ``amp`` (accelerate's ``MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)``)."""
    w = DTYPE_BYTES[wl.dtype] if wl.mixed_policy else DTYPE_BYTES[wl.param_dtype]
    return w, 4 if wl.mixed_policy and wl.precision == "mixed" else w


@dataclass(frozen=True)
class Gathered:
    """What FSDP2 holds beyond the one-device step's bytes on one rank, phase by phase (module docstring)."""

    root: float
    """w x the root's parameters (embeddings, final norm, output layer): gathered the whole step."""
    layers: tuple[float, ...]
    """w x each layer's parameters."""
    reduce: tuple[float, ...]
    """r x each layer's parameters: its reduce-scatter input."""
    head_grads: float
    """w x the parameters whose gradients the head's backward makes (final norm, output layer or the tied
    embedding): unsharded until the root reduces them at the end of the backward."""
    root_reduce: float
    """r x the root's parameters: its reduce-scatter input, at the end of the backward."""
    w: int = 2

    @classmethod
    def of(cls, root: float, layers: Sequence[float], head: float, *, w: int, r: int) -> Gathered:
        """From parameter counts: the root's, each layer's, and those whose gradients the head's backward makes."""
        return cls(
            root=float(w * root),
            layers=tuple(float(w * p) for p in layers),
            reduce=tuple(float(r * p) for p in layers),
            head_grads=float(w * head),
            root_reduce=float(r * root),
            w=w,
        )

    @property
    def n(self) -> int:
        return len(self.layers)

    def forward(self, j: int) -> float:
        """Beyond the one-device step during layer j's forward."""
        return self.root + 2 * self.layers[j]

    def loss(self) -> float:
        """During the head's forward and the loss."""
        return self.root

    def backward(self, j: int) -> float:
        """During layer j's backward (its replay included)."""
        prefetched = self.layers[j - 1] if j > 0 else 0.0
        held = self.reduce[j + 1] if j + 1 < self.n else 0.0
        return self.root + self.layers[j] + prefetched + held + self.head_grads

    def embedding(self) -> float:
        """During the embedding's backward, the last of the step's backward."""
        root_grads = self.root  # the root's unsharded gradients (w each), the head's and the embedding's
        return self.root + root_grads + self.root_reduce


def gathered(spec: ModelSpec, wl: Workload) -> Gathered:
    """FSDP2's transients for ``spec`` on one rank of ``wl`` (one tensor-parallel rank's parameters)."""
    w, r = gathered_bytes(wl)
    n = -(-spec.n_layers // wl.pp)
    layers = [layer_params(spec, i).per_rank(wl.tp, wl.ep) for i in range(n)]
    root = embedding_params(spec) // wl.tp + (head_params(spec) if wl.pp == 1 else 0)
    head = norm_params(spec) + spec.vocab * spec.hidden // wl.tp
    return Gathered.of(root, layers, head, w=w, r=r)

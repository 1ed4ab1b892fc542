"""The analytic estimate of one training step: memory by component, peak, FLOPs and overhead.

Pure standard library: ``recompute estimate`` answers without importing torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from recompute.core.analytic.flops import layer_flops, model_flops, recompute_flops
from recompute.core.analytic.memory import (
    PART_GROUP,
    LayerActivations,
    layer_activations,
    loss_chunk,
    outer_activations,
)
from recompute.core.analytic.params import ModelStates, layer_params, model_states, norm_params
from recompute.core.analytic.sharding import Gathered, gathered
from recompute.core.policy import POLICIES, Policy, check_analytic
from recompute.core.spec import ModelSpec
from recompute.core.table import gib
from recompute.core.workload import Workload

__all__ = [
    "Estimate",
    "GradientArrival",
    "after_backward",
    "estimate",
    "estimate_policies",
    "gradient_arrival",
    "in_flight",
    "layer_overheads",
    "resident_states",
]


@dataclass(frozen=True)
class Estimate:
    """Predicted memory (bytes, per rank, first pipeline stage) and FLOPs of one step under one policy."""

    model: str
    policy: str
    """The policy in words (``Policy.describe``)."""
    per_layer: tuple[str, ...]
    """The policy name of every layer of the model."""
    states: ModelStates
    activations: dict[str, float]
    """Stored activation bytes at the end of the forward by component, all micro-batches in flight."""
    peak: float
    """Predicted peak: model states + stored activations + the larger of the loss and recompute transients."""
    peak_phase: str
    """Where the peak happens: ``loss`` (start of the backward) or ``backward of layer j``."""
    loss_phase: float
    """Predicted bytes at the loss: model states, every stored activation, and the logits and loss
    transients; the trace's ``backward (head and loss)`` phase (with the chunked loss, whose gradients are
    taken in the forward, ``forward (head and loss)``)."""
    model_flops: float
    """FLOPs of forward + backward for one micro-batch (independent of the policy)."""
    recompute_flops: float
    """FLOPs replayed in the backward for one micro-batch."""
    notes: tuple[str, ...] = field(default=())
    """Which terms the estimate uses or leaves out."""
    host: float = 0.0
    """Host-memory bytes of the ``offload`` layers' saved tensors, all micro-batches in flight (not in ``peak``)."""

    @property
    def activation_bytes(self) -> float:
        return sum(self.activations.values())

    def __repr__(self) -> str:
        """One line; every field is ``to_dict()``'s."""
        return (
            f"Estimate({self.model!r}, {self.policy}: peak {gib(self.peak)}, activations "
            f"{gib(self.activation_bytes)}, recompute {100 * self.overhead:.1f}% of the step's FLOPs)"
        )

    @property
    def total(self) -> float:
        """Model states plus stored activations (no transients)."""
        return self.states.total + self.activation_bytes

    @property
    def hardware_flops(self) -> float:
        return self.model_flops + self.recompute_flops

    @property
    def overhead(self) -> float:
        """Recompute FLOPs as a fraction of the model FLOPs of the step."""
        return self.recompute_flops / self.model_flops

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            activation_bytes=self.activation_bytes,
            total=self.total,
            hardware_flops=self.hardware_flops,
            overhead=self.overhead,
            states=dict(asdict(self.states), total=self.states.total),
        )
        return out


def in_flight(wl: Workload) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once (Korthikanti Section 4.2).

    1F1B keeps p in flight on stage 0 (fewer if the step has fewer micro-batches); the interleaved schedule
    multiplies by 1 + (p - 1)/(p m).
    """
    p, m = wl.pp, wl.interleave
    if m > 1:
        return p * (1 + (p - 1) / (p * m))
    return float(min(p, wl.microbatches))


def _stage_layers(spec: ModelSpec, wl: Workload, per_layer: tuple[str, ...]) -> tuple[str, ...]:
    return per_layer[: -(-spec.n_layers // wl.pp)]


def estimate(spec: ModelSpec, wl: Workload, policy: Policy | str = "none") -> Estimate:
    """Predict memory and FLOPs of one training step of ``spec`` under ``wl`` with ``policy``.

    Raises:
        ConfigError: the workload does not fit the model, the policy is unknown, or it is a mixture-of-experts
            policy (``MOE_POLICIES``: measured by ``trace``, not modelled).
    """
    wl.check(spec)
    pol = Policy.parse(policy)
    check_analytic(pol)
    per_layer = pol.per_layer(spec.n_layers)
    stage = _stage_layers(spec, wl, per_layer)
    las = _stage_activations(spec, wl, len(stage))
    outer = outer_activations(spec, wl, last_stage=wl.pp == 1)
    k = in_flight(wl)

    activations: dict[str, float] = {}
    for (name, la), count in Counter(zip(stage, las)).items():
        for part, value in la.stored_by_component(name).items():
            group = PART_GROUP.get(part, part)
            activations[group] = activations.get(group, 0.0) + k * count * value
    activations.update(embedding=k * outer.embedding, head=outer.head, logits=outer.logits)

    states = model_states(spec, wl)
    grads = gradient_arrival(spec, wl, states)
    sharded = gathered(spec, wl) if wl.fsdp else None
    peak_act, phase = _peak_activations(
        las, stage, k, outer.embedding * k, outer.head + outer.logits, outer.loss_transient, outer.kept_logits, grads,
        sharded,
    )  # fmt: skip
    host = k * sum(la.offloaded(name) for la, name in zip(las, stage))
    resident = resident_states(wl, states)
    held = outer.embedding * k + outer.kept_logits
    peak_act, phase = max((peak_act, phase), after_backward(spec, wl, states, held, logits=outer.kept_logits))
    stored = k * (sum(la.stored(name) for la, name in zip(las, stage)) + outer.embedding) + outer.head + outer.logits
    loss_phase = resident + stored + outer.loss_transient + (sharded.loss() if sharded else 0.0)  # the first one
    #                                                                                   of _peak_activations
    return Estimate(
        model=spec.name,
        policy=pol.describe(),
        per_layer=per_layer,
        states=states,
        activations=activations,
        peak=resident + peak_act,
        peak_phase=phase,
        loss_phase=loss_phase,
        model_flops=model_flops(spec, wl),
        recompute_flops=recompute_flops(spec, wl, per_layer),
        notes=_notes(spec, wl, pol, host),
        host=host,
    )


def _stage_activations(spec: ModelSpec, wl: Workload, n: int) -> list[LayerActivations]:
    """Each layer's activations on the first stage (they differ for transformers' classes: the first layer's
    shared tables, dense and MoE layers)."""
    if not spec.transformers:
        return [layer_activations(spec, wl)] * n
    return [layer_activations(spec, wl, i) for i in range(n)]


def _peak_activations(
    las: list[LayerActivations],
    stage: tuple[str, ...],
    k: float,
    embedding: float,
    head: float,
    loss: float,
    kept_logits: float,
    grads: GradientArrival,
    sharded: Gathered | None = None,
) -> tuple[float, str]:
    """Largest activation footprint over the backward of a chain of layers (plus the gradients made so far).

    At the loss: every stored byte plus the logits and loss gradients. Then layer j (top down): the layers
    below j still stored, other micro-batches in flight, layer j's recompute transient and workspace, and
    the logits the training loop still holds, and the gradients made so far (``GradientArrival``); under
    ``offload``, layer j's transient is all it saves (copied back), and layer j - 1's, when offloaded, is being
    copied back meanwhile: at most two layers' worth in flight. ``sharded``: FSDP's gathered parameters and
    unsharded gradients in each phase (``recompute.core.analytic.sharding``).
    """
    stored = [la.stored(name) for la, name in zip(las, stage)]
    offloaded = [la.offloaded(name) for la, name in zip(las, stage)]
    others = (k - 1) * sum(stored)
    best, phase = others + sum(stored) + embedding + head + loss + (sharded.loss() if sharded else 0.0), "loss"
    below = 0.0
    for j, name in enumerate(stage):
        below += stored[j]
        made = grads.before(j, len(stage))
        copied_back = offloaded[j - 1] if j else 0.0  # the layer below, copied back meanwhile when offloaded
        value = others + below + las[j].transient(name) + las[j].workspace + embedding + kept_logits + made
        value += copied_back + (sharded.backward(j) if sharded else 0.0)
        if value > best:
            best, phase = value, f"backward of layer {j}"
    return best, phase


@dataclass(frozen=True)
class GradientArrival:
    """Gradient bytes made by the backward so far, when ``zero_grad()`` freed them (zero with ``keep_grads``).

    Note: [gradients arrive top down] the backward makes the output layer's (and the final norm's) gradients
    first, then each layer's as it passes it; layer j's own appear after its recompute transient has peaked.
    A tied embedding's gradient comes with the output layer's; an untied one, last.
    """

    head: float
    """Made before the first layer's backward: output layer, final norm, a tied embedding."""
    layer: float
    """Made by each layer's backward."""

    def before(self, j: int, n: int) -> float:
        """Gradient bytes that exist while layer j of n runs its backward."""
        return self.head + self.layer * (n - 1 - j)


def gradient_arrival(spec: ModelSpec, wl: Workload, states: ModelStates) -> GradientArrival:
    """The gradients the backward makes, for a step whose gradients start as None (``keep_grads`` off)."""
    if wl.keep_grads:
        return GradientArrival(0.0, 0.0)
    per = states.gradients / states.params if states.params else 0.0
    n = -(-spec.n_layers // wl.pp)
    layer = sum(layer_params(spec, i).per_rank(wl.tp, wl.ep) for i in range(n)) / n  # the stage's mean layer
    head = norm_params(spec) + spec.vocab * spec.hidden / wl.tp  # final norm; output layer (or tied embedding)
    if wl.fsdp:  # the root's gradients stay unsharded to the end of the backward (Gathered.head_grads)
        return GradientArrival(head=0.0, layer=layer * per)
    return GradientArrival(head=head * per if wl.pp == 1 else 0.0, layer=layer * per)


def resident_states(wl: Workload, states: ModelStates) -> float:
    """Model-state bytes that exist all step: gradients only with ``keep_grads``."""
    return states.total if wl.keep_grads else states.parameters + states.optimizer


def after_backward(
    spec: ModelSpec, wl: Workload, states: ModelStates, held: float, *, logits: float = 0.0
) -> tuple[float, str]:
    """The larger of the embedding's backward and the optimizer step, in bytes beyond ``resident_states``.

    ``held``: what the embedding's backward holds besides the gradients (its stored activations and the kept
    logits); ``logits``: the logits the training loop still holds in the optimizer step."""
    return max(_embedding_phase(spec, wl, states, held), _optimizer_phase(spec, wl, states, logits))


def _embedding_phase(spec: ModelSpec, wl: Workload, states: ModelStates, held: float) -> tuple[float, str]:
    """Bytes beyond the resident states during the embedding's backward, the last of the step's backward.

    Every other gradient exists (unless kept anyway); the embedding's dense gradient is made whole, (v, h)/t.
    Note: [a tied embedding's three] with the output layer's weight tied to it, autograd sums the output
    layer's contribution and the embedding's in a third buffer before it becomes ``.grad``: three (v, h)/t
    buffers at once (held to the trace). ``held``: the embedding's stored activations and the kept logits.
    """
    per = states.gradients / states.params if states.params else 0.0
    if wl.fsdp:  # the layers' sharded gradients, the root's gathered parameters and unsharded gradients
        root = gathered(spec, wl)
        layers = 0.0 if wl.keep_grads else states.gradients * sum(root.layers) / (sum(root.layers) + root.root)
        return layers + root.embedding() + held, "backward of the embedding"
    table = spec.vocab * spec.hidden / wl.tp * per
    tied_here = spec.tied_embeddings and wl.pp == 1
    others = 0.0 if wl.keep_grads else states.gradients - table
    return others + (3 if tied_here else 1) * table + held, "backward of the embedding"


def _optimizer_phase(spec: ModelSpec, wl: Workload, states: ModelStates, logits: float) -> tuple[float, str]:
    """Bytes beyond the resident states during the optimizer step: every gradient, AdamW's temporaries and the
    logits the training loop holds (``logits, loss = model(x, y)`` lives until the step ends).

    Note: [AdamW's temporaries] PyTorch's single-tensor AdamW (its default on the CPU) makes two temporaries of
    one parameter's moment at a time (``exp_avg_sq.sqrt() / bias_correction``): twice the largest parameter.
    On CUDA PyTorch defaults to the foreach implementation, whose ``_foreach_sqrt`` holds the square root of
    every parameter's second moment at once: one moment of the whole rank, or of its shard under the distributed
    optimizer (both held to the trace, which runs each device's default). Fused optimizers (Megatron's,
    ``fused=True``) make neither.
    """
    moment = 2 if wl.precision == "bf16" else 4  # Adam moments: fp32, or bf16 in the bf16 mode
    if wl.fsdp:
        moment = 2 if wl.precision == "bf16" else 4
    if wl.device == "cuda":  # the distributed optimizer and FSDP step their shard, 1/d of the rank's parameters
        temporaries = states.params * moment / (wl.dp if wl.precision == "distributed" or wl.fsdp else 1)
    else:
        largest = max(spec.vocab * spec.hidden, spec.hidden * spec.d_ff, spec.hidden * (spec.q_dim + 2 * spec.kv_dim))
        temporaries = 2 * largest / wl.tp / (wl.dp if wl.fsdp else 1) * moment
    grads = 0.0 if wl.keep_grads else states.gradients
    return grads + temporaries + logits, "optimizer step"


def _notes(spec: ModelSpec, wl: Workload, pol: Policy, host: float) -> tuple[str, ...]:
    notes = [
        f"attention {wl.attention}: "
        + ("the s^2 softmax is stored" if wl.attention == "eager" else "no s^2 term; fp32 log-sum-exp per row"),
        "dropout masks: " + _mask_note(spec, wl),
        f"model states: {wl.precision} precision",
    ]
    if wl.fsdp:
        notes.append(
            f"FSDP2 full shard over {wl.dp} ranks: states 1/{wl.dp} on each rank (padding left out), the root's "
            "and one layer's parameters gathered (two at its all-gather's copy-out, and the next one prefetched in "
            "the backward)" + (f", in {wl.dtype} from fp32 shards (MixedPrecisionPolicy)" if wl.mixed_policy else "")
        )
    if wl.pp > 1:
        layers = -(-spec.n_layers // wl.pp)
        notes.append(f"first pipeline stage: {layers} layers x {in_flight(wl):g} micro-batches in flight")
    if spec.transformers:
        notes.append(
            "from a transformers config: the formulas count what transformers' class saves (held to its trace, "
            "docs/analytic.md)"
        )
    if spec.n_experts:
        notes.append(
            f"experts: {spec.n_experts // wl.ep} of {spec.n_experts} per rank (ep {wl.ep}), top-{spec.top_k}, "
            f"{wl.routed_tokens(spec) / (wl.tokens * spec.top_k):g} x the expected load per rank"
        )
    if wl.loss == "chunked":
        notes.append(
            f"chunked loss: {loss_chunk(spec, wl)} tokens per chunk; one chunk's logits at a time, its gradients "
            "taken in the forward (nothing replayed), no logits kept"
        )
    if pol.save_ops or pol.offload:
        notes.append("op-level save lists and CPU offload are not modelled analytically; use `recompute trace`")
    if host:
        notes.append(
            f"offload: {host / 2**30:.3g} GiB of saved tensors in host memory; the device keeps none (tensors under "
            "64 KiB taken as none) but, in the backward, the layer consumed and the one prefetched; copy time is "
            "not modelled (taken as hidden behind compute)"
        )
    return tuple(notes)


def _mask_note(spec: ModelSpec, wl: Workload) -> str:
    if spec.dropout == 0:
        return "none (dropout 0)"
    return f"{1 if wl.device == 'cuda' else wl.element_bytes} B/element"


def estimate_policies(spec: ModelSpec, wl: Workload) -> list[Estimate]:
    """One uniform estimate per policy of DESIGN.md, in the order ``none`` ... ``block``."""
    return [estimate(spec, wl, name) for name in POLICIES]


def layer_overheads(spec: ModelSpec, wl: Workload) -> dict[str, float]:
    """The workshop's per-layer overhead F_recomputed / 3F for each policy (logits excluded)."""
    lf = layer_flops(spec, wl)
    return {name: lf.overhead(name) for name in POLICIES}

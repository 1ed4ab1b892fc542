"""``TraceResult``: what one traced training step allocated, by state, layer, component, op and phase."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed._tools.mem_tracker import _MemRefType

from recompute.core.allocator import replay
from recompute.core.states import Restate
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase, SavedRecord

__all__ = ["COMPONENTS", "PartTrace", "TraceResult", "from_record", "part_trace"]

COMPONENTS = ("attention", "mlp", "norms", "checkpoint", "other")
"""Components of a layer's saved bytes: by the layer's child module running when the tensor was saved;
``checkpoint`` is a whole-layer checkpoint's kept input, ``other`` what the layer itself saved."""


@dataclass(frozen=True)
class PartTrace:
    """Bytes one part of the model (a layer, the embedding, the head and loss) saved for the backward."""

    name: str
    components: dict[str, int]
    """Bytes by component (``COMPONENTS``); zero entries left out."""
    ops: dict[str, int]
    """Bytes by the backward node that first reads the tensor (``MmBackward0``, ``checkpoint``, ...)."""
    tensors: int
    """Number of storages saved on the device (each counted once, by its first saver)."""
    host: int = 0
    """Bytes saved in host memory instead (an ``offload`` layer's copies); not in ``components`` or ``total``."""

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), total=self.total)


@dataclass(frozen=True)
class TraceResult:
    """One training step of a model, traced on fake tensors: every byte allocated, by what it is for."""

    model: str
    policy: str
    """The policy in words (``Policy.describe``)."""
    per_layer: tuple[str, ...]
    """The policy of every layer."""
    workload: dict[str, Any]
    n_layers: int
    traced: tuple[int, ...]
    """Layer counts actually traced: ``(L,)`` for a full trace, ``(K, K + 1)`` when scaled to L."""
    parameters: int
    gradients: int
    """Gradients after the backward (all of them, as the optimizer step sees them)."""
    optimizer: int
    """Optimizer state (AdamW: two moments per parameter, plus step counters)."""
    other: int
    """Buffers and the batch (token ids and targets)."""
    layers: tuple[PartTrace, ...]
    embedding: PartTrace
    head: PartTrace
    """The final norm, the output layer and the loss."""
    peak: int
    """Largest total bytes allocated at once during the step."""
    peak_phase: str
    peak_breakdown: dict[str, int]
    """MemTracker's categories at the peak: Parameter, Gradient, Optstate, Activation, Temp, ..."""
    phases: dict[str, int]
    """Largest total bytes in each phase (forward/backward of the embedding, the layers, the head; step)."""
    notes: tuple[str, ...] = ()
    parameter_count: int = 0
    """Parameters of the model traced (each once, tied ones too), as ``model.num_parameters()`` counts them."""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of the trace."""
    host: int = 0
    """The most host-memory bytes alive at once: the ``offload`` layers' copies (in no device figure)."""
    reserved: int | None = None
    """What PyTorch's CUDA caching allocator is predicted to hold at most over a run of steps
    (``torch.cuda.max_memory_reserved``): the step's allocations and frees replayed by its rules
    (``recompute.core.allocator``). None off CUDA and for a scaled trace (its step was not run whole)."""

    @property
    def scaled(self) -> bool:
        """True when a few layers were traced and the figures scaled to all of them."""
        return self.traced != (self.n_layers,)

    @property
    def layer_activations(self) -> int:
        """Bytes the transformer layers save for the backward, all layers."""
        return sum(p.total for p in self.layers)

    @property
    def activations(self) -> int:
        """Bytes saved for the backward: layers, embedding, head and loss."""
        return self.layer_activations + self.embedding.total + self.head.total

    def __repr__(self) -> str:
        """One line; every figure is ``to_dict()``'s."""
        return (
            f"TraceResult({self.model!r}, {self.policy}: peak {self.peak / 2**30:.2f} GiB ({self.peak_phase}), "
            f"activations {self.activations / 2**30:.2f} GiB, {self.n_layers} layers)"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("layers",):
            out[key] = [p.to_dict() for p in getattr(self, key)]
        out.update(
            embedding=self.embedding.to_dict(),
            head=self.head.to_dict(),
            scaled=self.scaled,
            activations=self.activations,
            layer_activations=self.layer_activations,
        )
        return out


def part_trace(name: str, records: Iterable[SavedRecord]) -> PartTrace:
    """Sum saved records by component and by op."""
    components: dict[str, int] = {}
    ops: dict[str, int] = {}
    count = host = 0
    for r in records:
        if r.host:
            host += r.nbytes
            continue
        components[r.component] = components.get(r.component, 0) + r.nbytes
        ops[r.op] = ops.get(r.op, 0) + r.nbytes
        count += 1
    ordered = {c: components[c] for c in COMPONENTS if components.get(c)}
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    return PartTrace(name=name, components=ordered, ops=ops, tensors=count, host=host)


def _phase_group(phase: Phase) -> str:
    if phase.stage == "optimizer":
        return "optimizer step"
    part = "the layers" if phase.part == "layer" else "head and loss" if phase.part == "head" else phase.part
    return f"{phase.stage}: {part}"


def from_record(
    record: StepRecord,
    *,
    model: str,
    policy: str,
    per_layer: tuple[str, ...],
    workload: dict[str, Any],
    traced: tuple[int, ...],
    notes: tuple[str, ...] = (),
    seconds: float = 0.0,
    parameter_count: int = 0,
) -> TraceResult:
    """Aggregate a ``StepRecord`` into a ``TraceResult``, its model states priced for ``workload``'s precision
    (``recompute.core.states``; the step itself runs in one dtype, or under autocast for ``amp``); under ``fsdp``
    as traced (FSDP2's rank keeps its states in ``Workload.param_dtype``, gathered by its own policy)."""
    by_layer: dict[int, list[SavedRecord]] = {}
    for r in record.saved:
        by_layer.setdefault(r.layer, []).append(r)
    st = record.states
    precision = None if workload.get("fsdp") else workload.get("precision")  # FSDP2's states are traced as they are
    restate = Restate.of(st.get("Parameter", 0), workload.get("dtype", "fp32"), precision, workload.get("dp", 1),
                         traced=precision)  # fmt: skip
    priced = {
        ph: (round(restate.phase(value, parts, optimizer=ph.stage == "optimizer")), parts)
        for ph, (value, parts) in record.phase_peaks.items()
    }
    phase, (peak, _) = max(priced.items(), key=lambda kv: (kv[1][0], [-x for x in kv[0].order()]))
    phases: dict[str, int] = {}
    for ph, (value, _) in sorted(priced.items(), key=lambda kv: kv[0].order()):
        group = _phase_group(ph)
        phases[group] = max(phases.get(group, 0), value)
    states = {"Parameter": st.get("Parameter", 0), "Gradient": st.get("Gradient", 0), "Optstate": st.get("Optstate", 0)}
    if not restate.identity:
        priced_states = restate.states(dict(zip(("parameters", "gradients", "optimizer"), states.values())))
        states = dict(zip(states, (round(v) for v in priced_states.values())))
        notes = (*notes, restate.note())
    reserved = None
    if record.allocations is not None:  # the states repriced as the peak was; they are tensors of their own
        reserved = replay(record.allocations).reserved + peak - record.peak[0]
    return TraceResult(
        model=model,
        policy=policy,
        per_layer=per_layer,
        workload=workload,
        n_layers=record.n_layers,
        traced=traced,
        parameters=states["Parameter"],
        gradients=states["Gradient"],
        optimizer=states["Optstate"],
        other=st.get("Buffer", 0) + st.get("Other", 0),
        layers=tuple(part_trace(f"layer {j}", by_layer.get(j, [])) for j in range(record.n_layers)),
        embedding=part_trace("embedding", by_layer.get(-1, [])),
        head=part_trace("head and loss", by_layer.get(-2, [])),
        peak=peak,
        peak_phase=str(phase),
        peak_breakdown=_breakdown(record.phase_peaks[phase][1]),
        phases=phases,
        notes=notes,
        parameter_count=parameter_count,
        seconds=seconds,
        host=record.host_peak,
        reserved=reserved,
    )


def _breakdown(parts: dict[str, int]) -> dict[str, int]:
    """MemTracker's categories at the peak, every one of them (0 where none was allocated): one shape for every
    model (a preset had no ``Buffer``, a transformers class no ``Other``; issue 36), then ``Total``."""
    names = [str(t.value) for t in _MemRefType]
    return {k: int(parts.get(k, 0)) for k in dict.fromkeys([*names, *parts])}

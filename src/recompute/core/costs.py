"""``CostTable``: what every option costs each layer of a model, the one thing the planner reads. Torch-free.

A model's layers are a chain. For the first pipeline stage (the most loaded; its plan repeats on every stage)
the table gives, per kind of layer and per option (``none``, the recompute policies, ``offload``):

- the bytes a layer holds for the backward (``held``), which every later phase of the step carries;
- the peak of its forward phase and of its backward phase (the replay runs there) above their base;
- the bytes it adds to the next layer's backward (``below``: an offloaded layer's tensors, copied back while
  the layer above runs its backward);
- its recompute cost in FLOPs and, when priced on a device, in seconds; the host bytes it takes (offload).

What a layer holds and its backward peak may depend on the next layer's option (how the next layer hands it
the gradient), so they are given per pair of options (``links``). With H_i the bytes the layers below i hold,
S the stage's total and k the micro-batches in flight (pipelining), the peak of an assignment a is

    max( fixed, k' + max( head + S + dH(a_top),
                          max_i base_forward[i] + H_i + dF(a_i),
                          max_i base_backward[i] + H_i + dB(a_i, a_i+1) + below(a_i-1) ) ),   k' = (k - 1) S

(``CostTable.compose``). Two sources fill it: the analytic model for a preset
(``recompute.core.analytic.table``) and a measured profile for any other model (``Profile.cost_table``). The
planner (``recompute.core.search``) finds the least-cost assignment under a budget over any such table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from recompute.core.errors import ConfigError, require

__all__ = ["NEVER", "Composed", "CostTable", "KindCosts", "Link", "LinkCost", "TopCost"]

NEVER = -math.inf
"""A phase base the source does not model (the analytic model prices no layer's forward phase)."""


class LinkCost(NamedTuple):
    """What a layer under one option does when the next layer runs another."""

    held: float
    """Bytes it holds for the backward (every later phase carries them)."""
    backward: float
    """The peak of its backward phase above its base."""


class TopCost(NamedTuple):
    """What the top layer of the stage does under one option: the head follows it."""

    held: float
    backward: float
    head_forward: float
    """The head's forward phase above its base (the loss phase of the analytic model)."""
    head_backward: float


Link = Mapping[str, Mapping[str, LinkCost]]
"""``link[p][q]``: a layer under option p followed by one under option q."""


@dataclass(frozen=True)
class KindCosts:
    """One kind of layer (same class, parameters and attention type) and what each option does to it."""

    name: str
    """In words: ``LlamaDecoderLayer, full_attention, LlamaMLP``, or ``layer`` for a preset's alike layers."""
    options: tuple[str, ...]
    """The options this kind takes, ``none`` first."""
    forward: dict[str, float]
    """dF: the peak of the layer's forward phase above its base, by option."""
    kept: dict[str, float]
    """Bytes the layer saves for the backward, by option (what the report calls its activations)."""
    flops: dict[str, float]
    """FLOPs the option replays in the layer's backward (``none``: 0)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds the option adds to the layer's step on the device priced (replay, or offload's exposed copies);
    empty when the table is not priced in time."""
    below: dict[str, float] = field(default_factory=dict)
    """Bytes the layer adds to the backward of the layer above it (an offloaded layer's copies coming back);
    missing options add nothing."""
    host: dict[str, float] = field(default_factory=dict)
    """Host-memory bytes the layer takes under an option (offload), all micro-batches in flight."""
    refused: dict[str, str] = field(default_factory=dict)
    """Options this kind cannot take, with the reason."""

    def cost(self, option: str, timed: bool) -> float:
        """The option's cost in the table's unit: seconds when ``timed``, else FLOPs."""
        return self.seconds[option] if timed else self.flops[option]


@dataclass(frozen=True)
class Composed:
    """One assignment of options to the stage's layers, composed from a table."""

    layers: tuple[str, ...]
    """The option of each layer of the stage."""
    peak: float
    peak_phase: str
    held: float
    """S: bytes the stage's layers hold for the backward, one micro-batch."""
    flops: float
    """FLOPs replayed in the step (every stage)."""
    seconds: float | None
    """Seconds the assignment adds to the step, or None when the table is not priced in time."""
    host: float
    """Host-memory bytes of the stage's offloaded layers."""


@dataclass(frozen=True)
class CostTable:
    """Per layer of the first pipeline stage and per option: bytes, phases and cost (module docstring)."""

    model: str
    workload: dict[str, Any]
    """The workload priced (``Workload.to_dict``): the loss mode decides the head's phases."""
    kinds: tuple[KindCosts, ...]
    layer_kind: tuple[int, ...]
    """The kind of each layer of the stage."""
    links: dict[tuple[int, int], Link]
    """Per pair of kinds (a layer's, the next one's): ``link[p][q]`` (``Link``)."""
    last: dict[str, TopCost]
    """Per option of the top layer: what it holds, its backward delta and the head's deltas."""
    base_forward: tuple[float, ...]
    base_backward: tuple[float, ...]
    head_forward: float
    """The base of the loss phase: what exists besides the layers' held bytes when the head and loss run."""
    head_backward: float
    fixed: dict[str, float]
    """Peaks of the phases no option changes (the embedding's backward, the optimizer step), by phase name."""
    model_layers: int
    """Layers of the whole model (the stage's pattern repeats on every stage, cut to this many)."""
    model_flops: float
    """FLOPs of one micro-batch's forward and backward without recomputation."""
    tokens: int
    """Tokens of one micro-batch (b x s)."""
    in_flight: float = 1.0
    """k: micro-batches whose held bytes the stage keeps at once (Korthikanti Section 4.2)."""
    stages: int = 1
    """p: pipeline stages, each running the stage's plan (the step's recompute cost counts them all)."""
    model_seconds: float | None = None
    """The step's predicted (or measured) seconds without recomputation; None when not priced in time."""
    device: dict[str, Any] | None = None
    """The device the seconds are for (``Device.to_dict``), when priced on one."""
    cost_kind: str = "FLOPs"
    """What the table's costs are: ``FLOPs``, ``predicted seconds on <device>`` or ``measured seconds``."""
    phase_names: dict[str, str] = field(default_factory=dict)
    """How the source names the head's phases (``loss``, ``forward (head and loss)``)."""
    source: str = ""
    """Where the figures come from, in words (the analytic model; a profile of a class built from a file)."""
    notes: tuple[str, ...] = ()
    model_hash: str = ""
    """The hash of the model's architecture (``recompute.core.identity``), carried into the plan."""
    states: float = 0.0
    """Bytes of the rank's parameters, gradients and optimizer state (0: not said): what no plan can lower
    (``recompute.core.advice`` says so when they alone are over the budget)."""

    def __post_init__(self) -> None:
        require(len(self.layer_kind) > 0, f"{self.model}: a cost table needs at least one layer")
        require(
            len(self.base_forward) == len(self.base_backward) == len(self.layer_kind),
            f"{self.model}: one forward and one backward base per layer",
        )

    @property
    def n(self) -> int:
        """Layers in the stage."""
        return len(self.layer_kind)

    @property
    def timed(self) -> bool:
        """Costs are seconds (predicted or measured), not FLOPs."""
        return self.model_seconds is not None

    @property
    def model_cost(self) -> float:
        """The step's cost without recomputation in the table's unit."""
        return self.model_seconds if self.model_seconds is not None else self.model_flops

    def kind_of(self, layer: int) -> KindCosts:
        return self.kinds[self.layer_kind[layer]]

    def link(self, layer: int) -> Link:
        """The link of ``layer`` to the next layer of the stage."""
        return self.links[self.layer_kind[layer], self.layer_kind[layer + 1]]

    def options(self) -> tuple[str, ...]:
        """Options every layer takes, in the first kind's order."""
        return tuple(o for o in self.kinds[0].options if all(o in k.options for k in self.kinds))

    def whole_model(self, layers: Sequence[str]) -> tuple[str, ...]:
        """The whole model's options from the stage's (repeated on every stage)."""
        return (tuple(layers) * self.stages)[: self.model_layers]

    def compose(self, layers: Sequence[str]) -> Composed:
        """The exact peak (and its phase), held bytes, cost and host bytes of an assignment of the stage.

        Raises:
            ConfigError: the wrong number of layers, or an option a layer does not take.
        """
        n = self.n
        require(
            len(layers) == n,
            f"{len(layers)} layer options given for the {n} layers of {self.model}'s stage; give one per layer",
        )
        for i, name in enumerate(layers):
            kind = self.kind_of(i)
            if name not in kind.options:
                why = kind.refused.get(name, "not in its cost table")
                raise ConfigError(f"layer {i} ({kind.name}) cannot take {name!r}: {why}")
        phases: dict[str, float] = {}
        held = below = 0.0
        for i, name in enumerate(layers):
            kind = self.kind_of(i)
            phases[f"forward of layer {i}"] = self.base_forward[i] + held + kind.forward[name]
            if i < n - 1:
                grows, back = self.link(i)[name][layers[i + 1]]
            else:
                grows, back, head_f, head_b = self.last[name]
            phases[f"backward of layer {i}"] = self.base_backward[i] + held + back + below
            below = kind.below.get(name, 0.0)
            held += grows
        for which, base, delta in (
            ("head_forward", self.head_forward, head_f),
            ("head_backward", self.head_backward, head_b),
        ):
            name = self.phase_names.get(which, f"{which.split('_')[1]} (head and loss)")
            phases[name] = max(phases.get(name, NEVER), base + held + delta)
        extra = (self.in_flight - 1) * held
        phases = {name: value + extra for name, value in phases.items()}
        phases.update(self.fixed)
        phase, peak = max(phases.items(), key=lambda kv: kv[1])
        kinds = [self.kind_of(i) for i in range(n)]
        flops = self.stages * sum(k.flops[o] for k, o in zip(kinds, layers))
        seconds = self.stages * sum(k.seconds[o] for k, o in zip(kinds, layers)) if self.timed else None
        host = sum(k.host.get(o, 0.0) for k, o in zip(kinds, layers))
        return Composed(tuple(layers), peak, phase, held, flops, seconds, host)

    def cost(self, composed: Composed) -> float:
        """An assignment's recompute cost in the table's unit."""
        return composed.seconds if composed.seconds is not None else composed.flops

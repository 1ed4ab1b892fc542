"""``Profile``: what one layer of each kind of a real model keeps, replays and costs under every policy, and the
plans made from it. Torch-free: ``recompute.trace.profile`` measures it; this module reads, composes and plans.

A profile is measured on fake tensors of the model's own class (``recompute profile``):

- one step of the whole model under ``none`` gives, for every layer i, the peak of its forward and backward
  phases (``base_forward[i]``, ``base_backward[i]``), what it keeps, the head's and the fixed phases (the
  embedding's and the optimizer step's);
- steps of short models give, per kind and policy, what a layer saves, the peak of its forward phase (dF) and
  its FLOPs (the replay is part of its backward), and per pair of kinds that follow each other and pair of
  policies (the layer's, the next one's), what the layer holds for the backward (dK) and the peak of its
  backward phase (dB): a layer's backward depends on how the next layer hands it the gradient;
- under offload, also what a layer keeps in host memory and what its copies back add to the backward of the
  layer above it (``below``), which the composition adds there (``recompute.core.costs``).

Memory is additive, so for any per-layer assignment a, with P_i the sum of dK(a_j, a_j+1) over the layers
below i, the peak of the step is (``Profile.compose``)

    max( fixed, head + P_L + dH(a_L), max_i base_forward[i] + P_i + dF(a_i),
         max_i base_backward[i] + P_i + dB(a_i, a_i+1) ).

``tests/test_profile.py`` holds this to whole traces of every uniform policy and random mixes, byte for byte.
``Profile.cost_table`` turns it into the planner's ``CostTable`` (``recompute.core.costs``), which composes
exactly this, and which the one planner (``recompute.core.plan``) plans over as it does a preset's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from recompute.core.analytic.params import bytes_per_param
from recompute.core.analytic.sharding import Gathered, gathered_bytes
from recompute.core.costs import CostTable, KindCosts, LinkCost, TopCost
from recompute.core.errors import ConfigError, require
from recompute.core.files import atomic_write, read_json_file
from recompute.core.policy import OFFLOAD_POLICIES
from recompute.core.profile_schema import check_profile_dict
from recompute.core.states import Restate
from recompute.core.table import size
from recompute.core.timing import OPTIMIZER_PHASE, Device, Op, StepWork, replayed, work_seconds
from recompute.core.workload import Workload, build_workload, step_dtype

__all__ = ["FORMAT", "LastFigures", "LayerKind", "PairFigures", "Profile"]

FORMAT = "recompute.profile/2"


class PairFigures(NamedTuple):
    """A layer of one kind under policy p followed by one of a kind under policy q, against both under ``none``."""

    held: int
    """dK: what the layer holds for the backward."""
    backward: int
    """dB: the peak of its backward phase."""
    forward: int
    """dF: the peak of its forward phase."""


class LastFigures(NamedTuple):
    """The last layer under a policy, with the head after it, against ``none``."""

    backward: int
    """dB: the peak of its backward phase."""
    head_forward: int
    head_backward: int


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer (same class, parameters and attention type) and what each policy does to it."""

    name: str
    """In words: the layer class, its attention type and its MLP class."""
    layers: tuple[int, ...]
    """The model's layers of this kind."""
    parameters: int
    """Parameters of one layer."""
    kept: dict[str, int]
    """Bytes one layer saves for the backward on the device, by policy (each storage counted once, by its first
    saver; what an offloaded layer keeps in host memory is ``host``)."""
    held: dict[str, int]
    """Bytes one layer adds to what the backward inherits, by policy: the growth of allocated memory from the
    start of its forward to the start of the next layer's (what it saves, what a checkpoint holds, its input
    freed when nothing keeps it)."""
    components: dict[str, dict[str, int]]
    """``kept`` by component (attention, mlp, norms, checkpoint, other), by policy."""
    ops: dict[str, dict[str, int]]
    """``kept`` by the backward node that reads it, by policy."""
    forward_delta: dict[str, int]
    """dF: the peak of the layer's forward phase under a policy minus under ``none``, beside the change in
    what the layers below keep."""
    backward_delta: dict[str, int]
    """dB: the same for the layer's backward phase (the replay runs there)."""
    forward_flops: int
    backward_flops: dict[str, int]
    """FLOPs of the layer's backward phase by policy: the gradient's and the replay's."""
    forward_ops: dict[str, int]
    """``forward_flops`` by op."""
    backward_ops: dict[str, dict[str, int]]
    """``backward_flops`` by op, by policy."""
    forward_work: dict[str, tuple[Op, ...]] = field(default_factory=dict)
    """Every kernel of the layer's forward phase by work signature, by policy (``recompute.core.timing``)."""
    backward_work: dict[str, tuple[Op, ...]] = field(default_factory=dict)
    """The same for its backward phase, the replay included."""
    refused: dict[str, str] = field(default_factory=dict)
    """Policies that cannot apply to this layer, with the reason."""
    host: dict[str, int] = field(default_factory=dict)
    """Bytes one layer keeps in host memory, by policy: an offloaded layer's copies of what it saves (each storage
    once, by its first saver). Empty in profiles stored before offload was measured."""
    below: dict[str, int] = field(default_factory=dict)
    """Bytes one layer adds to the backward of the layer above it, by policy: an offloaded layer's copies come
    back when the next layer's backward starts (prefetched), the device blocks they take at its peak; 0 for a
    kind only last. Empty as ``host``."""

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(self.kept)

    def kept_delta(self, policy: str) -> int:
        """Bytes saved under ``policy`` minus under ``none``."""
        return self.kept[policy] - self.kept["none"]

    def held_delta(self, policy: str) -> int:
        """dK: bytes held for the backward under ``policy`` minus under ``none``."""
        return self.held[policy] - self.held["none"]

    def recompute_flops(self, policy: str) -> int:
        return self.backward_flops[policy] - self.backward_flops["none"]

    def seconds(self, policy: str, device: Device) -> float:
        """Predicted time of the layer's forward and backward (the replay included) under ``policy``."""
        return sum(self.phase_seconds(policy, device))

    def phase_seconds(self, policy: str, device: Device) -> tuple[float, float]:
        """Predicted time of the layer's forward and of its backward (the replay included) under ``policy``."""
        backward = self.backward_work[policy]
        again = replayed(backward, self.backward_work["none"])
        return work_seconds(self.forward_work[policy], device), work_seconds(backward, device, replayed=again)

    def recompute_seconds(self, policy: str, device: Device) -> float:
        """Predicted time ``policy`` adds to the layer: its replay, priced by the roofline of ``device`` (none for
        offload, which replays nothing: its copies run over the host link, ``recompute.core.pricing``).

        Never below 0, as for presets (``pricing.layer_costs``): the replay runs the layer's forward kernels
        again, so it adds time; a difference below 0 comes from pricing the checkpointed forward (run without
        autograd, another set of kernels) apart from none's, and a planner would take it as memory for free.
        """
        if policy in OFFLOAD_POLICIES:
            return 0.0
        return max(0.0, self.seconds(policy, device) - self.seconds("none", device))

    def replay_transient(self, policy: str) -> int:
        """Bytes the layer's backward peak holds beyond ``none``'s there, apart from what it keeps: the replay."""
        return self.backward_delta[policy] - self.held_delta(policy)


@dataclass(frozen=True)
class Profile:
    """A model's layers by kind and what every policy does to them; see the module docstring."""

    model: str
    origin: str
    class_name: str
    key: str
    """The store's key (``recompute.core.store.step_key``): the model, the workload and the library versions."""
    workload: dict[str, Any]
    kinds: tuple[LayerKind, ...]
    layer_kind: tuple[int, ...]
    """Index into ``kinds`` of every layer."""
    links: dict[str, dict[str, dict[str, PairFigures]]]
    """``links["a>b"][p][q]``: a layer of kind a under policy p followed by one of kind b under q."""
    last: dict[str, LastFigures]
    """``last[p]``: the last layer under p, with the head."""
    base_kept: tuple[int, ...]
    """Bytes each layer keeps under ``none`` in the whole model (the first also keeps what layers share)."""
    base_forward: tuple[int, ...]
    base_backward: tuple[int, ...]
    head_forward: int
    head_backward: int
    fixed: dict[str, int]
    """Peaks of the phases no policy changes: the embedding's forward and backward, the optimizer step."""
    parameters: int
    """Bytes of parameters (and of gradients, and AdamW's state, below), per device."""
    gradients: int
    optimizer: int
    other: int
    parameter_count: int
    embedding_kept: int
    head_kept: int
    step_flops: int
    """FLOPs of one step under ``none`` (forward and backward)."""
    outer_work: dict[str, tuple[Op, ...]] = field(default_factory=dict)
    """Every kernel of the phases outside the layers (embedding, head and loss, optimizer step), by phase."""
    tokens: int = 0
    """Tokens of the profiled step (micro-batch x sequence)."""
    notes: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    seconds: float = field(default=0.0, compare=False)
    phase_states: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(gradient bytes, optimizer temporaries) at the peak of each phase of the step under ``none``, by the
    phase's name: what ``restated`` re-prices when the states are asked for in another precision."""
    model_hash: str = ""
    """The hash of the model's architecture (``recompute.core.identity``); empty in profiles stored before it."""
    offload_shared: int = 0
    """Host bytes offload copies once however many layers it offloads: what the layers share (rotary tables,
    masks made before the first layer) that an offloaded layer saves, above ``recompute.offload.MIN_BYTES``. No
    layer's figures hold it (its copy back lives from the top offloaded layer's backward to the lowest's): a
    plan that offloads may differ by up to this much from its composed peak and host bytes."""

    def named(self, model: str, origin: str) -> Profile:
        """This profile under another name and origin: the store's key is the architecture's and the workload's,
        so the same model given by another file finds the profile another made, which would otherwise name that
        file (its notes too)."""
        if (self.model, self.origin) == (model, origin):
            return self
        notes = tuple(n.replace(self.origin, origin) for n in self.notes)
        return replace(self, model=model, origin=origin, notes=notes)

    @property
    def n_layers(self) -> int:
        return len(self.layer_kind)

    def __repr__(self) -> str:
        """One line; every figure is ``to_dict()``'s."""
        w = self.workload
        kinds = ", ".join(k.name for k in self.kinds)
        return (
            f"Profile({self.model!r}, {self.n_layers} layers of {len(self.kinds)} kind(s): {kinds}; "
            f"b={w.get('micro_batch')} s={w.get('seq_len')} {step_dtype(w.get('dtype'), w.get('precision'))} on "
            f"{w.get('device')})"
        )

    def kind_of(self, layer: int) -> LayerKind:
        return self.kinds[self.layer_kind[layer]]

    def link(self, i: int) -> dict[str, dict[str, PairFigures]]:
        """The link of layer ``i`` to layer ``i + 1`` (``links``)."""
        return self.links[f"{self.layer_kind[i]}>{self.layer_kind[i + 1]}"]

    def step_work(self, layers: Sequence[str]) -> StepWork:
        """Every kernel of the step under a per-layer assignment: the phases outside the layers, then each
        layer's under its policy (measured per kind, so exact for layers of one kind alike)."""
        phases = dict(self.outer_work)
        for i, name in enumerate(layers):
            kind = self.kind_of(i)
            phases[f"forward of layer {i}"] = kind.forward_work[name]
            phases[f"backward of layer {i}"] = kind.backward_work[name]
        return StepWork(phases, self.tokens)

    def step_seconds(self, layers: Sequence[str], device: Device) -> float:
        return self.step_work(layers).seconds(device)

    def applicable(self) -> tuple[str, ...]:
        """Policies every layer takes."""
        return tuple(p for p in self.kinds[0].policies if all(p in k.kept for k in self.kinds))

    def activations(self, layers: Sequence[str]) -> int:
        """Bytes kept for the backward under a per-layer assignment: by the layers, the embedding and the head."""
        saved = sum(self.kind_of(i).kept_delta(name) for i, name in enumerate(layers))
        return sum(self.base_kept) + saved + self.embedding_kept + self.head_kept

    def offloads(self) -> bool:
        """Whether this profile measured offload (profiles stored before it did have no host figures)."""
        return any(k.host for k in self.kinds)

    def cost_table(self, device: Device | None = None, *, offload: Mapping[int, float] | None = None) -> CostTable:
        """The planner's table of this profile: costs in FLOPs, or with a ``device`` the replays' predicted
        seconds there (the step's too). Held bytes are relative to ``none`` (the base phases hold ``none``'s):
        a profile is of one device's step, with one micro-batch in flight.

        Args:
            offload: per kind (its index), the cost of offloading one of its layers in the table's unit
                (``recompute.core.pricing.profile_offload_seconds`` on a device); kinds left out, and every
                kind without it, do not take offload (priced by nothing, its copies would look free)."""
        offload = offload or {}
        kinds = tuple(self._kind_costs(i, device, offload.get(i)) for i in range(len(self.kinds)))
        links = {
            tuple(int(x) for x in pair.split(">")): {
                p: {q: LinkCost(float(v.held), float(v.backward)) for q, v in row.items()} for p, row in table.items()
            }
            for pair, table in self.links.items()
        }
        return CostTable(
            model=self.model,
            workload=self.workload_dict(),
            kinds=kinds,
            layer_kind=self.layer_kind,
            links=links,  # type: ignore[arg-type]
            last={
                p: TopCost(0.0, float(v.backward), float(v.head_forward), float(v.head_backward))
                for p, v in self.last.items()
            },
            base_forward=tuple(float(v) for v in self.base_forward),
            base_backward=tuple(float(v) for v in self.base_backward),
            head_forward=float(self.head_forward),
            head_backward=float(self.head_backward),
            fixed={k: float(v) for k, v in self.fixed.items()},
            model_layers=self.n_layers,
            model_flops=float(self.step_flops),
            tokens=self.tokens,
            model_seconds=self.step_seconds(["none"] * self.n_layers, device) if device else None,
            device=device.to_dict() if device else None,
            cost_kind=f"predicted seconds on {device.label}" if device else "FLOPs",
            source=f"profile {self.key} of {self.class_name} built from {self.origin}",
            notes=(*self.notes, *self._offload_notes(kinds)),
            model_hash=self.model_hash,
            states=float(self.parameters + self.gradients + self.optimizer),
        )

    def _offload_notes(self, kinds: Sequence[KindCosts]) -> tuple[str, ...]:
        """What a table that weighs offload leaves out (``offload_shared``)."""
        if not self.offload_shared or not any(p in OFFLOAD_POLICIES for k in kinds for p in k.options):
            return ()
        return (
            f"offload copies {size(self.offload_shared)} the layers share (rotary tables, masks) once, whichever "
            "layers it offloads: a plan that offloads may peak, and take host memory, up to that much off its figures",
        )

    def _kind_costs(self, i: int, device: Device | None, offload: float | None) -> KindCosts:
        """Kind ``i``'s figures in a cost table, offload among its options where ``offload`` prices it."""
        k = self.kinds[i]
        left_out = {
            p: "its price is copy time over a GPU's host link, not priced here" if p in k.host else "not measured"
            for p in k.policies
            if p in OFFLOAD_POLICIES and (offload is None or p not in k.host)
        }
        names = tuple(p for p in k.policies if p not in left_out)

        def cost(p: str, replay: float) -> float:
            return float(offload) if p in OFFLOAD_POLICIES and offload is not None else float(replay)

        return KindCosts(
            name=k.name,
            options=names,
            forward={p: float(k.forward_delta[p]) for p in names},
            kept={p: float(k.kept[p]) for p in names},
            flops={p: cost(p, k.recompute_flops(p)) if device is None else float(k.recompute_flops(p)) for p in names},
            seconds={p: cost(p, k.recompute_seconds(p, device)) for p in names} if device else {},
            below={p: float(k.below[p]) for p in names if k.below.get(p)},
            host={p: float(k.host[p]) for p in names if k.host.get(p)},
            refused={**k.refused, **left_out},
        )

    def restated(self, precision: str | None, dp: int = 1, *, fsdp: bool = False) -> Profile:
        """This profile with its model states priced for ``precision`` over ``dp`` data-parallel ranks (the
        distributed optimizer shards over them; ``fsdp``: FSDP2's full shard, its gathered parameters and
        unsharded gradients added phase by phase, ``recompute.core.analytic.sharding``): the step was measured as
        plain training in its dtype, and every phase that holds the states moves with them
        (``recompute.core.states``). The activations, and so every policy's deltas, do not change.

        Raises:
            ConfigError: another precision asked of a profile stored before it recorded its phases' gradients.
        """
        dtype, ran = str(self.workload.get("dtype", "fp32")), self.workload.get("precision")
        if self.workload.get("fsdp"):  # one FSDP rank traced as it is: its own workload only
            asked = (precision or ran, dp, fsdp)
            require(
                asked == (ran, self.workload.get("dp"), True),
                f"this profile is of one rank of FSDP over {self.workload.get('dp')} ranks under {ran}; profile "
                "the model again for another sharding or precision",
                fields=("precision", "dp", "fsdp"),
            )
            return self
        restate = Restate.of(self.parameters, dtype, precision, dp, traced=str(ran) if ran else None, fsdp=fsdp)
        workload = {**self.workload, "precision": restate.wanted, "dp": dp, **({"fsdp": True} if fsdp else {})}
        if restate.identity and dp == 1:
            return replace(self, workload=workload)
        require(
            bool(self.phase_states),
            f"this profile predates the states it needs to be priced in {restate.wanted} precision; make it "
            "again with recompute profile (or plan without --profile: the cache re-measures it)",
            fields=("precision",),
        )
        gather = self._gathered(build_workload(**{**self.workload_dict(), **workload}), restate) if fsdp else None

        def moved(name: str, value: int) -> int:
            grads, temps = self.phase_states.get(name, (0, 0))
            if gather is None:
                return round(
                    restate.phase(value, {"Gradient": grads, "Temp": temps}, optimizer=name == OPTIMIZER_PHASE)
                )
            root = gather.root_part(name, grads, self.phase_states, keep=bool(self.workload.get("keep_grads")))
            layers = grads - root
            out = restate.phase(value, {"Gradient": layers, "Temp": temps}, optimizer=name == OPTIMIZER_PHASE)
            return round(out + root * (gather.w / gather.traced_grad - 1) + gather.at(name))

        states = restate.states(
            {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer}
        )
        return replace(
            self,
            workload=workload,
            base_forward=tuple(moved(f"forward of layer {i}", v) for i, v in enumerate(self.base_forward)),
            base_backward=tuple(moved(f"backward of layer {i}", v) for i, v in enumerate(self.base_backward)),
            head_forward=moved("forward (head and loss)", self.head_forward),
            head_backward=moved("backward (head and loss)", self.head_backward),
            fixed={name: moved(name, v) for name, v in self.fixed.items()},
            parameters=round(states["parameters"]),
            gradients=round(states["gradients"]),
            optimizer=round(states["optimizer"]),
            notes=(*self.notes, restate.note()),
        )

    def _gathered(self, wl: Workload, restate: Restate) -> _PhaseGathered:
        """FSDP's transients by phase name, from this profile's parameter counts (module ``sharding``)."""
        layers = [self.kinds[k].parameters for k in self.layer_kind]
        root = self.parameter_count - sum(layers)
        w, r = gathered_bytes(wl)
        traced = bytes_per_param(restate.traced)["gradients"]
        return _PhaseGathered(Gathered.of(root, layers, 0, w=w, r=r), root_grads=root * traced, traced_grad=traced, w=w)

    def workload_dict(self) -> dict[str, Any]:
        """The profiled workload as a whole ``Workload.to_dict`` (one device, its own loss mode)."""
        return Workload(**self.workload).to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        require(data.get("format") == FORMAT, f"not a {FORMAT} file (format {data.get('format')!r})")
        check_profile_dict(data)
        body = {k: v for k, v in data.items() if k != "format"}
        body["kinds"] = tuple(
            LayerKind(
                **{
                    **k,
                    "layers": tuple(k["layers"]),
                    "forward_work": _works(k["forward_work"]),
                    "backward_work": _works(k["backward_work"]),
                }
            )
            for k in body["kinds"]
        )
        body["outer_work"] = _works(body["outer_work"])
        body["phase_states"] = {k: (int(v[0]), int(v[1])) for k, v in (body.get("phase_states") or {}).items()}
        for key in ("layer_kind", "base_kept", "base_forward", "base_backward", "notes"):
            body[key] = tuple(body[key])
        body["links"] = {
            pair: {p: {q: PairFigures(*map(int, v)) for q, v in row.items()} for p, row in table.items()}
            for pair, table in body["links"].items()
        }
        body["last"] = {p: LastFigures(*map(int, v)) for p, v in body["last"].items()}
        return cls(**body)

    def save(self, path: str | Path) -> None:
        atomic_write(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Raises: ConfigError: not a readable profile file."""
        try:
            data = read_json_file(path, "--profile", what="a profile", fix="make one with recompute profile -o")
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"--profile {str(path)!r}: {e}" if str(path) not in str(e) else str(e)) from None
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(
                f"--profile {str(path)!r}: not a readable recompute profile ({type(e).__name__}); run recompute profile"
            ) from None


def _works(raw: dict[str, Any]) -> dict[str, tuple[Op, ...]]:
    return {k: tuple((str(o[0]), str(o[1]), int(o[2]), int(o[3]), int(o[4])) for o in v) for k, v in raw.items()}


@dataclass(frozen=True)
class _PhaseGathered:
    """FSDP's gathered parameters by a profile's phase name, and the root's gradients it keeps unsharded."""

    gathered: Gathered
    root_grads: float
    """Bytes of the root's gradients as the one-device step made them (the traced dtype)."""
    traced_grad: float
    """Bytes of a gradient element in the traced step."""
    w: float
    """Bytes of a gathered element: what FSDP's unsharded gradients take."""

    def root_part(self, name: str, grads: float, states: Mapping[str, tuple[int, int]], *, keep: bool) -> float:
        """The root's gradients among ``grads``, the one-device bytes of gradients at phase ``name``: FSDP keeps
        them unsharded until the end of the backward (the head's, made first; at the embedding's backward,
        all of the root's). Kept gradients (``keep_grads``) exist sharded from the start: none."""
        if keep or name == OPTIMIZER_PHASE:
            return 0.0
        if name == "backward (embedding)":
            return min(grads, self.root_grads)
        head = max(states.get("forward (head and loss)", (0, 0))[0], states.get("backward (head and loss)", (0, 0))[0])
        return min(grads, head)

    def at(self, name: str) -> float:
        """Bytes of gathered parameters and reduce-scatter inputs during the phase ``name`` (no gradients)."""
        g = self.gathered
        if name.startswith(("forward of layer ", "backward of layer ")):
            j = int(name.rsplit(" ", 1)[1])
            return g.forward(j) if name.startswith("forward") else g.backward(j)
        if name == "forward (embedding)":
            return 2 * g.root
        if name == "backward (embedding)":
            return g.root + g.root_reduce
        if name == OPTIMIZER_PHASE:
            return 0.0
        return g.loss()

"""``Profile``: what one layer of each kind of a real model keeps, replays and costs under every policy, and the
plans made from it. Torch-free: ``recompute.trace.profile`` measures it; this module reads, composes and plans.

A profile is measured on fake tensors of the model's own class (``recompute profile``):

- one step of the whole model under ``none`` gives, for every layer i, the peak of its forward and backward
  phases (``base_forward[i]``, ``base_backward[i]``), what it keeps, the head's and the fixed phases (the
  embedding's and the optimizer step's);
- steps of short models give, per kind and policy, what a layer saves, the peak of its forward phase (dF) and
  its FLOPs (the replay is part of its backward), and per pair of kinds that follow each other and pair of
  policies (the layer's, the next one's), what the layer holds for the backward (dK) and the peak of its
  backward phase (dB): a layer's backward depends on how the next layer hands it the gradient.

Memory is additive, so for any per-layer assignment a, with P_i the sum of dK(a_j, a_j+1) over the layers
below i, the peak of the step is (``Profile.compose``)

    max( fixed, head + P_L + dH(a_L), max_i base_forward[i] + P_i + dF(a_i),
         max_i base_backward[i] + P_i + dB(a_i, a_i+1) ).

``tests/test_profile.py`` holds this to whole traces of every uniform policy and random mixes, byte for byte.

``plan`` finds the least-cost assignment whose composed peak fits a budget: every constraint grows with the
prefix P, so a dynamic program over the layers that keeps, per policy of the current layer, the Pareto set of
(P, cost) and drops the points that break a constraint is exact, for any mix of layer kinds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recompute.core.errors import ConfigError, require
from recompute.core.files import read_json_file
from recompute.core.profile_schema import check_profile_dict
from recompute.core.table import GiB, gib
from recompute.core.timing import Device, Op, StepWork, work_seconds

__all__ = [
    "FORMAT",
    "PROFILED_WORKLOAD",
    "Composed",
    "LayerKind",
    "Profile",
    "ProfilePlan",
    "cache_key",
    "cache_path",
    "cached",
    "cached_work",
    "plan_profile",
    "plan_profiles",
    "smallest_peak",
    "work_path",
]

FORMAT = "recompute.profile/2"

PROFILED_WORKLOAD = ("micro_batch", "seq_len", "dtype", "attention", "device", "keep_grads", "loss", "loss_chunk")
"""The workload fields a profile depends on (one device: no parallelism; the loss decides the head's phases)."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide what a step saves (read from the installed metadata, no import)."""
    out = {}
    for name in ("torch", "transformers", "recompute"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def cache_key(model: dict[str, Any], workload: dict[str, Any]) -> str:
    """The profile's identity: its model's config, the workload fields it depends on and the library versions."""
    wl = {k: workload[k] for k in PROFILED_WORKLOAD}
    blob = json.dumps(
        {"format": FORMAT, "model": model, "workload": wl, "versions": library_versions()}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """``$RECOMPUTE_CACHE``, default ``~/.cache/recompute``: measured profiles and step work are kept there."""
    return Path(os.environ.get("RECOMPUTE_CACHE") or Path.home() / ".cache" / "recompute")


def cache_path(key: str) -> Path:
    """Where a profile is cached: ``$RECOMPUTE_CACHE/profiles/<key>.json``."""
    return cache_root() / "profiles" / f"{key}.json"


def work_path(key: str, policy: str) -> Path:
    """Where a step's kernels under a uniform policy are cached: ``$RECOMPUTE_CACHE/work/<key>-<policy>.json``."""
    return cache_root() / "work" / f"{key}-{policy}.json"


def cached_work(key: str, policy: str) -> StepWork | None:
    """The cached step work of ``key`` under ``policy``, or None (an unreadable cache file counts as none)."""
    path = work_path(key, policy)
    if not path.is_file():
        return None
    try:
        return StepWork.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached(key: str) -> Profile | None:
    """The cached profile of ``key``, or None (an unreadable cache file counts as none)."""
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        found = Profile.load(path)
    except ConfigError:
        return None
    return found if found.key == key else None


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
    """Bytes one layer saves for the backward, by policy (each storage counted once, by its first saver)."""
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
        return work_seconds(self.forward_work[policy], device) + work_seconds(self.backward_work[policy], device)

    def recompute_seconds(self, policy: str, device: Device) -> float:
        """Predicted time ``policy`` adds to the layer: its replay, priced by the roofline of ``device``."""
        return self.seconds(policy, device) - self.seconds("none", device)

    def replay_transient(self, policy: str) -> int:
        """Bytes the layer's backward peak holds beyond ``none``'s there, apart from what it keeps: the replay."""
        return self.backward_delta[policy] - self.held_delta(policy)


@dataclass(frozen=True)
class Composed:
    """A per-layer assignment of policies, composed from a profile."""

    layers: tuple[str, ...]
    peak: int
    peak_phase: str
    activations: int
    """Bytes kept for the backward by the layers, the embedding and the head."""
    recompute_flops: int
    recompute_seconds: float | None = None
    """The replays' predicted time on the device the assignment was composed for (``compose(..., device)``)."""
    step_seconds: float | None = None
    """The whole step's predicted time there."""

    def overhead(self, step_flops: int) -> float:
        return self.recompute_flops / step_flops if step_flops else 0.0

    @property
    def time_overhead(self) -> float | None:
        """Replay time over the time of the same step without it."""
        if self.recompute_seconds is None or self.step_seconds is None:
            return None
        base = self.step_seconds - self.recompute_seconds
        return self.recompute_seconds / base if base else 0.0


@dataclass(frozen=True)
class Profile:
    """A model's layers by kind and what every policy does to them; see the module docstring."""

    model: str
    origin: str
    class_name: str
    key: str
    """The cache key: a hash of the config, the workload and the library versions."""
    workload: dict[str, Any]
    kinds: tuple[LayerKind, ...]
    layer_kind: tuple[int, ...]
    """Index into ``kinds`` of every layer."""
    links: dict[str, dict[str, dict[str, tuple[int, int, int]]]]
    """``links["a>b"][p][q]``: for a layer of kind a under policy p followed by one of kind b under q,
    (dK, dB, dF): the bytes it holds and the peaks of its backward and forward phases, against both running
    ``none``."""
    last: dict[str, tuple[int, int, int]]
    """``last[p]``: for the last layer under p, (dB, the head's forward delta, the head's backward delta)."""
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

    @property
    def n_layers(self) -> int:
        return len(self.layer_kind)

    def kind_of(self, layer: int) -> LayerKind:
        return self.kinds[self.layer_kind[layer]]

    def link(self, i: int) -> dict[str, dict[str, tuple[int, int, int]]]:
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

    def compose(self, layers: Sequence[str], device: Device | None = None) -> Composed:
        """The exact peak, activations and recompute FLOPs of a per-layer assignment (module docstring), and
        with a ``device`` its predicted replay and step times there.

        Raises:
            ConfigError: the assignment has the wrong length or a policy a layer does not take.
        """
        require(
            len(layers) == self.n_layers,
            f"{len(layers)} layer policies given for {self.model}'s {self.n_layers} layers; give one per layer",
        )
        phases: dict[str, int] = dict(self.fixed)
        prefix = saved = flops = 0
        n = self.n_layers
        for i, name in enumerate(layers):
            kind = self.kind_of(i)
            if name not in kind.kept:
                why = kind.refused.get(name, "not profiled")
                raise ConfigError(f"layer {i} ({kind.name}) cannot take policy {name!r}: {why}")
            forward = kind.forward_delta[name]
            saved += kind.kept_delta(name)
            flops += kind.recompute_flops(name)
            if i < n - 1:
                held, backward, _ = self.link(i)[name][layers[i + 1]]
                phases[f"forward of layer {i}"] = self.base_forward[i] + prefix + forward
                phases[f"backward of layer {i}"] = self.base_backward[i] + prefix + backward
                prefix += held
            else:
                backward, head_forward, head_backward = self.last[name]
                phases[f"forward of layer {i}"] = self.base_forward[i] + prefix + forward
                phases[f"backward of layer {i}"] = self.base_backward[i] + prefix + backward
                phases["forward (head and loss)"] = self.head_forward + prefix + head_forward
                phases["backward (head and loss)"] = self.head_backward + prefix + head_backward
        phase, peak = max(phases.items(), key=lambda kv: kv[1])
        kept = sum(self.base_kept) + saved + self.embedding_kept + self.head_kept
        if device is None:
            return Composed(tuple(layers), peak, phase, kept, flops)
        replay = sum(self.kind_of(i).recompute_seconds(name, device) for i, name in enumerate(layers))
        return Composed(tuple(layers), peak, phase, kept, flops, replay, self.step_seconds(layers, device))

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
        for key in ("layer_kind", "base_kept", "base_forward", "base_backward", "notes"):
            body[key] = tuple(body[key])
        body["links"] = {
            pair: {p: {q: (int(v[0]), int(v[1]), int(v[2])) for q, v in row.items()} for p, row in table.items()}
            for pair, table in body["links"].items()
        }
        body["last"] = {p: (int(v[0]), int(v[1]), int(v[2])) for p, v in body["last"].items()}
        return cls(**body)

    def save(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(target)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Raises: ConfigError: not a readable profile file."""
        try:
            data = read_json_file(path, "--profile", what="a profile", fix="make one with recompute profile -o")
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(
                f"{path}: not a readable recompute profile ({type(e).__name__}); run recompute profile"
            ) from None


def _works(raw: dict[str, Any]) -> dict[str, tuple[Op, ...]]:
    return {k: tuple((str(o[0]), str(o[1]), int(o[2]), int(o[3]), int(o[4])) for o in v) for k, v in raw.items()}


@dataclass(frozen=True)
class ProfilePlan:
    """The least-cost assignment that fits, from a profile, with the frontier and the uniform policies."""

    profile: Profile
    budget: float
    chosen: Composed
    frontier: tuple[Composed, ...]
    uniform: dict[str, Composed]
    device: Device | None = None
    """The device the plan's costs are predicted times on; None: the plan minimises recomputed FLOPs."""

    @property
    def overhead(self) -> float:
        """The chosen plan's time overhead on the device, or its FLOP overhead."""
        return _overhead(self.chosen, self.profile)

    @property
    def cost_kind(self) -> str:
        return f"predicted seconds on {self.device.label}" if self.device else "FLOPs"

    def to_dict(self) -> dict[str, Any]:
        """A plan file: ``Policy.from_dict`` reads its ``policy`` entry, so ``apply`` takes the file as is."""
        p = self.profile

        def point(c: Composed) -> dict[str, Any]:
            out = {"peak": c.peak, "cost": _cost(c), "overhead": _overhead(c, p), "layers": list(c.layers)}
            if c.step_seconds is not None:
                out |= {"step_seconds": c.step_seconds, "tokens_per_second": p.tokens / c.step_seconds}
                out |= {"recompute_flops": c.recompute_flops, "flop_overhead": c.overhead(p.step_flops)}
            return out

        return {
            "format": "recompute.plan/1",
            "model": p.model,
            "workload": p.workload,
            "budget": self.budget,
            "cost_kind": self.cost_kind,
            "device": self.device.to_dict() if self.device else None,
            "source": f"profile {p.key} of {p.class_name} built from {p.origin}",
            "policy": {"format": "recompute.policy/1", "model": p.model, "layers": list(self.chosen.layers)},
            "predicted": {
                "peak": self.chosen.peak,
                "peak_phase": self.chosen.peak_phase,
                "activations": self.chosen.activations,
                "overhead": self.overhead,
                "cost": _cost(self.chosen),
                "step_seconds": self.chosen.step_seconds,
                "tokens_per_second": p.tokens / self.chosen.step_seconds if self.chosen.step_seconds else None,
                "traced_peak": None,
            },
            "frontier": [point(c) for c in self.frontier],
            "uniform": {name: point(c) for name, c in self.uniform.items()},
        }


def _cost(c: Composed) -> float:
    return c.recompute_seconds if c.recompute_seconds is not None else c.recompute_flops


def _overhead(c: Composed, profile: Profile) -> float:
    time = c.time_overhead
    return time if time is not None else c.overhead(profile.step_flops)


def _fits(profile: Profile, budget: float, *, costs: bool = True) -> Composed | None:
    """``_search``'s chosen assignment alone."""
    return _search(profile, budget, costs=costs)[0]


def _search(
    profile: Profile, budget: float, *, costs: bool = True, device: Device | None = None
) -> tuple[Composed | None, list[Composed]]:
    """The least-cost assignment whose composed peak is at most ``budget``, or None (exact; module docstring).

    A state is (what the layers below the current one hold, cost so far, the current layer's policy); a layer's
    backward and what it holds depend on the next layer's policy, so both are settled when that is chosen.
    States with the same current policy are pruned to their Pareto set; every constraint grows with the held
    bytes, so nothing that could lead to a cheaper fitting plan is dropped. ``costs=False`` ignores the costs:
    the least held bytes per policy are all that feasibility needs. The cost of a layer's policy is its
    replay's predicted time on ``device``, or without one its recomputed FLOPs.

    Also returns the Pareto front of (peak, cost) among the final states: plans that fit, for the frontier.
    """
    import numpy as np

    n = profile.n_layers
    fixed = max(profile.fixed.values(), default=0)
    if fixed > budget:
        return None, []

    names_of = [list(k.policies) for k in profile.kinds]
    dk = [np.array([k.forward_delta[p] for p in names_of[j]], dtype=float) for j, k in enumerate(profile.kinds)]

    def layer_cost(k: LayerKind, p: str) -> float:
        if not costs:
            return 0.0
        return k.recompute_seconds(p, device) if device is not None else float(k.recompute_flops(p))

    rc = [np.array([layer_cost(k, p) for p in names_of[j]], dtype=float) for j, k in enumerate(profile.kinds)]
    tables = {}  # per link: what the layer holds and its backward delta, (its policy, the next one's)
    for key, link in profile.links.items():
        a, b = (int(x) for x in key.split(">"))
        tables[key] = tuple(
            np.array([[link[p][q][f] for q in names_of[b]] for p in names_of[a]], dtype=float) for f in (0, 1)
        )

    def options(i: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        k = profile.layer_kind[i]
        return names_of[k], profile.base_forward[i] + dk[k], rc[k]

    names, forward, cost = options(0)
    ok = forward <= budget
    prefix, total, last = np.zeros(int(ok.sum())), cost[ok], np.flatnonzero(ok)
    peak = np.maximum(forward[ok], fixed)  # the highest phase so far, carried for the frontier
    steps: list[tuple[np.ndarray, np.ndarray, list[str]]] = [(np.full(len(last), -1), last, names)]
    for i in range(1, n):
        names, forward, cost = options(i)
        held, back = tables[f"{profile.layer_kind[i - 1]}>{profile.layer_kind[i]}"]
        back = back + profile.base_backward[i - 1]
        parents_all, options_all, prefix_all, total_all, peak_all = [], [], [], [], []
        for o in range(len(names)):
            new_prefix = prefix + held[last, o]
            high = np.maximum(prefix + back[last, o], new_prefix + forward[o])
            idx = np.flatnonzero(high <= budget)
            if idx.size == 0:
                continue
            m, c = new_prefix[idx], total[idx] + cost[o]
            order = np.lexsort((c, m))
            best_before = np.concatenate(([np.inf], np.minimum.accumulate(c[order])[:-1]))
            keep = order[c[order] < best_before]
            parents_all.append(idx[keep])
            options_all.append(np.full(len(keep), o))
            prefix_all.append(m[keep])
            total_all.append(c[keep])
            peak_all.append(np.maximum(peak[idx[keep]], high[idx[keep]]))
        if not parents_all:
            return None, []
        parents = np.concatenate(parents_all)
        last = np.concatenate(options_all)
        prefix, total, peak = np.concatenate(prefix_all), np.concatenate(total_all), np.concatenate(peak_all)
        steps.append((parents, last, names))
    names = steps[-1][2]
    end = np.array([profile.last[p] for p in names], dtype=float)  # (options, 3)
    high = np.maximum.reduce(
        [profile.base_backward[n - 1] + end[:, 0], profile.head_forward + end[:, 1], profile.head_backward + end[:, 2]]
    )
    final = np.maximum(peak, prefix + high[last])
    fit = np.flatnonzero(final <= budget)
    if fit.size == 0:
        return None, []

    def layers(index: int) -> Composed:
        chosen: list[str] = []
        for parents, opts, step_names in reversed(steps):
            chosen.append(step_names[int(opts[index])])
            index = int(parents[index])
        return profile.compose(chosen[::-1], device)

    order = fit[np.lexsort((total[fit], final[fit]))]
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(total[order])[:-1]))
    front = [layers(int(i)) for i in order[total[order] < best_before]]
    return layers(int(fit[np.argmin(total[fit])])), front


def smallest_peak(profile: Profile) -> float:
    """The smallest achievable peak: bisection on the budget, each tried by ``_fits`` without costs."""
    lo, hi = 0.0, float(profile.compose(["none"] * profile.n_layers).peak)
    while hi - lo > max(1.0, hi * 1e-7):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _fits(profile, mid, costs=False) is not None else (mid, hi)
    return hi


def plan_profile(profile: Profile, budget: float, device: Device | None = None) -> ProfilePlan:
    """The least-cost per-layer policy whose exact composed peak fits ``budget`` bytes: least predicted time on
    ``device`` (the replays priced by its roofline), or without one the fewest recomputed FLOPs.

    Raises:
        ConfigError: nothing fits; the message gives the smallest achievable peak.
    """
    return plan_profiles([profile], budget, device)


def plan_profiles(profiles: Sequence[Profile], budget: float, device: Device | None = None) -> ProfilePlan:
    """``plan_profile`` over profiles of one model in several loss modes: the plan of least step cost that fits.

    The step cost is the chosen plan's predicted step seconds on ``device`` (each loss mode's own step, its
    replays added), or without one its recomputed FLOPs (the chunked loss replays nothing). At equal cost the
    earlier profile wins: put the loss the user has first, as switching changes the training loop.

    Raises:
        ConfigError: no profile's plan fits; the message gives the smallest achievable peak over all of them.
    """
    found = []
    for i, profile in enumerate(profiles):
        chosen, front = _search(profile, budget, device=device)
        if chosen is not None:
            found.append((_step_cost(chosen), i, profile, chosen, front))
    if not found:
        peak, i = min((smallest_peak(p), i) for i, p in enumerate(profiles))
        raise _nothing_fits(profiles[i], budget, peak)
    _, _, profile, chosen, front = min(found, key=lambda f: (f[0], f[1]))
    uniform = {p: profile.compose([p] * profile.n_layers, device) for p in profile.applicable()}
    return ProfilePlan(profile, budget, chosen, tuple(front), uniform, device)


def _step_cost(c: Composed) -> float:
    return c.step_seconds if c.step_seconds is not None else c.recompute_flops


def _nothing_fits(profile: Profile, budget: float, smallest: float) -> ConfigError:
    loss = profile.workload.get("loss", "full")
    return ConfigError(
        f"no plan fits {budget / GiB:.1f} GiB: the smallest achievable peak of {profile.model} at "
        f"b={profile.workload.get('micro_batch')} s={profile.workload.get('seq_len')} is {gib(smallest)} "
        f"(by its profile, {loss} loss); use a smaller micro-batch or sequence, or more GPUs",
        fields=("budget",),
    )

"""``profile(model, workload)``: measure a ``Profile`` (``recompute.core.profile``) on fake tensors of the real class.

Three kinds of step, all traced like ``trace`` (nothing allocated):

1. the whole model under ``none``: every layer's forward and backward peak, what each keeps, the head's and
   the fixed phases, the model states and the step's FLOPs;
2. the links: for every pair of kinds that follow each other in the model and every pair of policies (the
   layer's, the next one's), what a layer at a generic position holds for the backward and the peaks of its
   forward and backward phases. A layer's backward depends on how the next one hands it the gradient, so its
   figures are measured per policy of the next layer. All of them come from the chained steps (``_chain``:
   models whose layers walk through every transition, in parts side by side, each figure equal to that of a
   short model of the transition alone); a kind's own figures (what it saves, by component and op; its FLOPs
   and kernels) from its layers there followed by one under ``none``. Layers are copies of the model's own (with their
   attention type, dense or MoE MLP);
3. anchors: per policy, the last layer with the head after it (its backward and the head's phases), the
   leading layers (the first of each kind) under that policy where they take it, as in the whole model when
   every layer runs it.

A policy a layer cannot take is recorded with its reason. Offload is measured as the others are; the tracker
follows the copies an offloaded layer's tensors come back in, which count in the backward of the layer above it
(``LayerKind.below``) and are taken off every layer's own backward figure (``_rise``). The loss mode changes the
head and the step's fixed phases, not the layers: ``profiles`` measures the links once for several loss modes.

Note: [anchors once for every loss mode] The anchors are measured once too, under the first loss mode, and
serve every other: what they give are differences against ``none`` (``LastFigures``: the last layer's backward
peak, the head's forward and backward peaks, each against the same anchor under ``none``), and the last layer's
policy shifts what is held through the head's phases by the same bytes whatever the loss does there; the loss's
own transients cancel in the difference. A loss mode's whole step (its own head, fixed phases and states) is still
measured under it. ``tests/test_profile.py`` holds each loss mode's profile from a pass led by another loss mode
to the one measured alone, byte for byte (``benchmarks/cold_plan.py --precision bf16`` does too, against the
revision before, at Qwen2.5-1.5B's size).

What a layer adds to the memory the backward inherits is measured as the growth of allocated bytes from the
start of its forward to the start of the next one's: that counts what it saves, what a checkpoint holds by
reference, and its input freed when nothing keeps it. Saved-tensor bytes alone would not add up: a storage
two layers need is counted once, by whichever saves it first.

Layers are of one kind when they have the same class, the same parameters (names and shapes) and the same
attention type; they are never assumed alike otherwise.

Over 400 lines because one measurement has three coupled parts: the shape of what to measure (kinds, anchors, the
chained step), the steps themselves, and the assembly of their figures into a ``Profile``; the chain's walk lives in
``_chain``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from recompute.checkpointing import apply, find_layers
from recompute.core import store
from recompute.core.errors import ConfigError, first_line, require
from recompute.core.policy import MOE_POLICIES, OFFLOAD_POLICIES, POLICIES, Policy
from recompute.core.profile import LastFigures, LayerKind, PairFigures, Profile
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.timing import work_list
from recompute.core.workload import AMP, LOSSES, Workload, parallel_sizes
from recompute.models.identity import model_identity
from recompute.models.source import BuiltModel, ModelSource
from recompute.runtime import TORCH_DTYPES
from recompute.trace._build import build_meta, fake_kernels
from recompute.trace._chain import (
    Node,
    Site,
    chain,
    chain_positions,
    chain_sites,
    cut,
    dropped_below,
    kind_keys,
    lead_picks,
    leads,
)
from recompute.trace._cuda import fake_device_note, trace_device
from recompute.trace._kinds import layer_kinds, ranges, short_model
from recompute.trace._mesh import fake_group
from recompute.trace._run import _check_traceable, _source_of, step_built
from recompute.trace._scale import scale_whole
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase
from recompute.trace._workers import run_jobs, side_workers

__all__ = ["cached_profile", "cached_profiles", "profile", "profile_key", "profiles", "with_loss"]

WHOLE_K = 3
"""The whole step of a model of more than ``2 * WHOLE_K + 1`` alike layers is traced at ``WHOLE_K`` and
``WHOLE_K + 1`` layers and scaled (``_Shape.whole_models``); 3 is the least that gives every layer's phase."""


def profiled_policies() -> tuple[str, ...]:
    """Every policy name ``apply`` knows (a policy a layer cannot take is recorded as refused)."""
    return (*POLICIES, *MOE_POLICIES, *OFFLOAD_POLICIES)


def profile_key(source: ModelSource, wl: Workload) -> str | None:
    """The store's key of ``source`` at ``wl``; None for a factory (its code is not a config to hash)."""
    if source.raw is not None:
        identity = store.config_identity(source.raw)
    elif source.spec is not None:
        identity = store.spec_identity(source.spec.to_dict(), hf=source.hf)
    else:
        return None
    return store.step_key(identity, wl.to_dict())


def cached_profile(
    model: ModelSpec | ModelSource | str, wl: Workload, *, progress: Progress = no_progress
) -> tuple[Profile, bool]:
    """The profile of ``model`` at ``wl`` from the cache, or measured now and cached; and whether it was cached."""
    return cached_profiles(model, wl, (wl.loss,), progress=progress)[wl.loss]


def cached_profiles(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    losses: Sequence[str] = LOSSES,
    *,
    progress: Progress = no_progress,
) -> dict[str, tuple[Profile, bool]]:
    """``cached_profile`` under each loss mode in ``losses``: those not cached are measured together
    (``profiles``) and cached, each under its own key (the loss mode is part of it)."""
    source = _source_of(model, False)
    _one_device(wl)  # before the store is read: its key does not hold the parallel sizes (issue 38)
    workloads = {loss: with_loss(wl, loss) for loss in dict.fromkeys(losses)}
    keys = {loss: profile_key(source, w) for loss, w in workloads.items()}
    found = {loss: _cached(key) if key else None for loss, key in keys.items()}
    missing = [loss for loss, hit in found.items() if hit is None]
    measured = profiles(source, wl, missing, progress=progress) if missing else {}
    out: dict[str, tuple[Profile, bool]] = {}
    for loss, hit in found.items():
        if hit is not None:
            out[loss] = hit.named(source.name, source.origin), True
            continue
        key = keys[loss]
        if key:
            store.save("profiles", key, measured[loss].to_dict())
        out[loss] = measured[loss], False
    return out


def _one_device(wl: Workload) -> None:
    """A profile measures one rank's step: one device's, or one of FSDP2's ``dp`` ranks (traced as itself)."""
    sizes, fields = parallel_sizes(wl, ("tp", "pp") if wl.fsdp else ("tp", "pp", "dp"))
    require(
        not fields,
        f"a profile measures one device's step (or one FSDP rank's, with --fsdp); drop {sizes} (recompute "
        "estimate --analytic models them)",
        fields=fields,
    )


def _cached(key: str) -> Profile | None:
    """The stored profile of ``key``, or None (missing, unreadable, or stored under another key)."""
    found = store.load("profiles", key, Profile.from_dict)
    return found if found is not None and found.key == key else None


def profile(model: ModelSpec | ModelSource | str, wl: Workload, *, progress: Progress = no_progress) -> Profile:
    """Measure ``model``'s profile at ``wl`` (see the module docstring).

    Raises:
        ConfigError: as ``trace``; and parallelism (a profile is of one device: use ``--analytic`` estimates).
    """
    return profiles(model, wl, (wl.loss,), progress=progress)[wl.loss]


def profiles(
    model: ModelSpec | ModelSource | str,
    wl: Workload,
    losses: Sequence[str] = LOSSES,
    *,
    progress: Progress = no_progress,
    workers: int | None = None,
) -> dict[str, Profile]:
    """``profile`` of ``model`` at ``wl`` under each loss mode in ``losses``, by loss mode, in one pass: the
    links are measured once, the whole step and the anchors once per loss mode. Each is the ``Profile`` that
    ``profile(model, with_loss(wl, loss))`` measures.

    Args:
        workers: processes that run steps beside this one (``_workers.run_jobs``; default: one per other usable
            CPU, 0: every step here). The figures do not depend on it.

    Raises:
        ConfigError: as ``profile``; a loss mode the workload cannot take (the chunked loss in fp16).
    """
    source = _source_of(model, False)
    _one_device(wl)
    workloads = {loss: with_loss(wl, loss) for loss in dict.fromkeys(losses)}
    for w in workloads.values():
        _check_traceable(source, w)
    device = trace_device(wl.device)
    start = time.perf_counter()
    # Note: [an FSDP rank's profile] the whole step (every phase's peak, the states) is one FSDP rank's, traced
    # as it is on a fake process group; what each policy does to a layer (the short models, the chain) is the
    # one-device step's, whose activations are the rank's (its weights in the dtype FSDP gathers them in): in the
    # chain FSDP's gradients would blur the per-layer backward figures (tests/test_fsdp.py holds the composition
    # to whole FSDP traces).
    one = _one_rank_stand_in(wl)
    weights = wl.dtype if wl.mixed_policy else None
    with fake_kernels():
        shape = _Shape.of(source, one, weights)
        parts = _parts(shape, 1 + side_workers(workers))
        positions, refs = _part_positions(shape, parts)
        # Every model built on meta before a step makes one of them fake: the chained ones and the anchors once
        # (Note: [anchors once for every loss mode]).
        first = next(iter(workloads))
        whole = {loss: shape.whole_models(wl.fsdp) for loss in workloads}
        anchors, chained = shape.models(parts)
        stand_in = _one_rank_stand_in(workloads[first])
        jobs: list[Callable[[], Any]] = [
            partial(_chain_step, shape, part, where | ref, built, stand_in, device)
            for part, where, ref, built in zip(parts, positions, refs, chained)
        ]
        jobs += [partial(_whole_step, source, m, w, device) for loss, w in workloads.items() for m in whole[loss]]
        for (_, p, x), short in zip(shape.anchors, anchors):
            per_layer = Policy(layers=(*leads(p, shape.ok)[:x], p))
            jobs.append(partial(_anchor_step, short, stand_in, per_layer, device, shape.only_last))
        progress("profile", 0, len(jobs))
        done = run_jobs(jobs, workers=workers, done=lambda n: progress("profile", n, len(jobs)))
    chain_recs = [done.pop(0) for _ in parts]
    wholes = {loss: _whole_of([done.pop(0) for _ in whole[loss]], len(shape.layers)) for loss in workloads}
    records, shared = {}, {}
    for tag, p, x in shape.anchors:
        rec = done.pop(0)
        records[tag, p] = Site(rec, x, -dropped_below(rec, x))
        shared[p] = rec.phase_shared.get(Phase("backward", "layer", x), 0)
    lead_sites: dict[tuple[Any, ...], Site] = {}
    for rec, where, ref in zip(chain_recs, positions, refs):
        sites = chain_sites(rec, where | ref, shared)
        lead_sites = lead_sites or sites
        records |= _rebased(sites, set(ref), lead_sites)
    seconds = time.perf_counter() - start
    return {
        loss: shape.profile(source, workloads[loss], base, n_params, records, seconds)
        for loss, (base, n_params) in wholes.items()
    }


def _one_rank_stand_in(wl: Workload) -> Workload:
    """The one-device step whose layers stand in for an FSDP rank's (Note: [an FSDP rank's profile]); ``wl``
    itself when it is not sharded."""
    return dataclasses.replace(wl, fsdp=False, dp=1) if wl.fsdp else wl


def _whole_step(source: ModelSource, whole: BuiltModel, wl: Workload, device: str) -> tuple[StepRecord, int]:
    """The step under ``none`` of ``whole`` (the whole model, or a cut of it: ``_Shape.whole_models``) and its
    parameter count: one FSDP rank's under ``wl.fsdp`` (the whole model built again in its parameters' dtype,
    sharded on a fake process group)."""
    if not wl.fsdp:
        record, _, n_params = step_built(whole, wl, Policy("none"), device=device, flops=True)
        return record, n_params
    with fake_group(wl):
        sharded = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[wl.param_dtype])
        record, _, n_params = step_built(sharded, wl, Policy("none"), device=device, flops=True)
    return record, n_params


def _whole_of(steps: Sequence[tuple[StepRecord, int]], n: int) -> tuple[StepRecord, int]:
    """The whole step's record and parameter count from ``_whole_step``'s steps of what ``_Shape.whole_models``
    gave: the whole model's own, or scaled to ``n`` layers from those of ``WHOLE_K`` and ``WHOLE_K + 1`` (Note:
    [every layer's phase] in ``_scale``), run as two jobs."""
    if len(steps) == 1:
        return steps[0]
    (small, params), (big, params_big) = steps
    return scale_whole(small, big, n, WHOLE_K), params + (n - WHOLE_K) * (params_big - params)


def with_loss(wl: Workload, loss: str) -> Workload:
    """``wl`` with loss mode ``loss`` (its chunk kept for the chunked loss).

    Raises:
        ConfigError: ``loss`` is not a loss mode, or one ``wl`` cannot take (the chunked loss in fp16).
    """
    return dataclasses.replace(wl, loss=loss, loss_chunk=wl.loss_chunk if loss == "chunked" else None)


def _anchor_step(short: BuiltModel, wl: Workload, policy: Policy, device: str, flops: bool) -> StepRecord:
    """An anchor's short model's step (``_Shape.anchors``)."""
    return step_built(short, wl, policy, device=device, flops=flops, step=False, owners=True)[0]


def _parts(shape: _Shape, n: int) -> list[tuple[Node, ...]]:
    """The chain in up to ``n`` parts (Note: [the chain in parts]), each led by the walk of every pair of kinds
    under ``none`` (``_Shape.refs``): its own references."""
    return [(*shape.refs, *part) for part in cut(shape.chain, n)] if shape.chain else []


def _part_positions(
    shape: _Shape, parts: Sequence[tuple[Node, ...]]
) -> tuple[list[dict[tuple[Any, ...], int]], list[dict[tuple[Any, ...], int]]]:
    """Per part of the chain: where each transition is measured (in the first part that walks it, at the index of
    its first layer in that part's model), and where the part's own references (every pair of kinds under
    ``none``, at its start) are."""
    out: list[dict[tuple[Any, ...], int]] = []
    refs: list[dict[tuple[Any, ...], int]] = []
    seen: set[tuple[Any, ...]] = set()
    lead = len(shape.lead_policies)
    for part in parts:
        found = chain_positions(part, lead, set(shape.pairs))
        refs.append(chain_positions(part[: len(shape.refs)], lead, set(shape.pairs)))
        out.append({key: x for key, x in found.items() if key not in seen and key not in refs[-1]})
        seen |= set(found)
    return out, refs


def _rebased(
    sites: dict[tuple[Any, ...], Site], refs: set[tuple[Any, ...]], first: dict[tuple[Any, ...], Site]
) -> dict[tuple[Any, ...], Site]:
    """A part's sites, less its references unless it is the first part, each backward figure moved by what its
    pair's reference measures in this part beyond the first (Note: [the chain in parts])."""
    out = {}
    for key, site in sites.items():
        ref = (*key[:3], "none", "none")
        if sites is first or key not in refs:
            d = _rise(sites[ref], "backward", "layer") - _rise(first[ref], "backward", "layer")
            out[key] = dataclasses.replace(site, above=site.above + d)
    return out


def _chain_step(
    shape: _Shape,
    part: tuple[Node, ...],
    positions: dict[tuple[Any, ...], int],
    built: BuiltModel,
    wl: Workload,
    device: str,
) -> StepRecord:
    """A part of the chained step (``_chain``), FLOPs and kernels counted where a kind's come from
    (``chain_sites`` turns it into its links' sites)."""
    per_layer = (*shape.lead_policies, *(p for _, p in part), "none")
    counted = {positions[key] for key in kind_keys(shape.pairs, shape.ok) if key in positions}
    pol = Policy(layers=per_layer)
    return step_built(built, wl, pol, device=device, flops=True, step=False, owners=True, flop_layers=counted)[0]


@dataclass(frozen=True)
class _Shape:
    """What a profile measures of a model: its layers by kind, the policies each takes, the transitions between
    kinds, the chain that walks them and the anchors."""

    whole: BuiltModel
    """The model on the meta device."""
    layers: nn.ModuleList
    kind_of: tuple[int, ...]
    reps: tuple[int, ...]
    """The first layer of each kind."""
    labels: tuple[str, ...]
    refused: tuple[dict[str, str], ...]
    ok: tuple[tuple[str, ...], ...]
    """The policies each kind takes."""
    pairs: tuple[tuple[int, int], ...]
    chain: tuple[Node, ...]
    refs: tuple[Node, ...]
    """A walk of every pair of kinds under ``none``: each part of the chain starts with it (``_parts``)."""
    anchors: tuple[tuple[str, str, int], ...]
    """(tag, policy, index of the measured layer): ``last`` the last layer with the head after it, per
    policy; ``alone`` for a policy the chain runs that the last layer cannot take, a layer of a kind that
    takes it (what the layers share that its leading layers keep, for ``chain_sites``)."""
    picks: tuple[tuple[int, ...], ...]
    """The model's layers each anchor's short model copies."""

    @classmethod
    def of(cls, source: ModelSource, wl: Workload, weights: str | None = None) -> _Shape:
        """``weights``: the dtype to build the parameters in, instead of ``wl.param_dtype``."""
        whole = build_meta(source, attention=wl.attention, dtype=TORCH_DTYPES[weights or wl.param_dtype])
        layers = find_layers(whole.model)
        found = layer_kinds(whole.model, layers)
        kind_of, reps, labels = list(found.kind_of), list(found.reps), found.labels
        n, lead = len(layers), len(reps)
        refused = tuple(_refused(whole, layers, r) for r in reps)
        ok = tuple(tuple(p for p in profiled_policies() if p not in refused[k]) for k in range(lead))
        pairs = tuple(sorted({(kind_of[i], kind_of[i + 1]) for i in range(n - 1)}))
        order = tuple(chain(pairs, ok))
        refs = tuple(chain(pairs, [("none",)] * lead))
        x_last = lead if n > 1 else 0
        anchors = [("last", p, x_last) for p in ok[kind_of[-1]]]
        picks = [tuple([*reps, n - 1] if n > 1 else [0]) for _ in anchors]
        for p in dict.fromkeys(p for _, p in order):
            if p not in ok[kind_of[-1]]:
                k = next(k for k in range(lead) if p in ok[k])
                anchors.append(("alone", p, lead))
                picks.append((*reps, reps[k]))
        return cls(
            whole, layers, tuple(kind_of), tuple(reps), tuple(labels), refused, ok, pairs, order, refs,
            tuple(anchors), tuple(picks),
        )  # fmt: skip

    @property
    def lead_policies(self) -> tuple[str, ...]:
        """The policies of the chain's leading layers (``lead_picks``)."""
        return tuple(p for k in range(len(self.reps)) for p in self.ok[k])

    @property
    def only_last(self) -> bool:
        """Whether a kind is only the model's last layer (its own figures come from the anchors)."""
        return any(k not in {a for a, _ in self.pairs} for k in range(len(self.reps)))

    def whole_models(self, fsdp: bool) -> tuple[BuiltModel, ...]:
        """Meta copies of what the whole step runs (``_whole_step``): where the layers are all alike and more than
        ``2 * WHOLE_K + 1``, the model cut to ``WHOLE_K`` and ``WHOLE_K + 1`` layers, whose steps scale to the
        whole one exactly (Note: [every layer's phase] in ``_scale``); else the whole model (an FSDP2 rank's is
        built sharded in the step)."""
        n = len(self.layers)
        if fsdp or len(self.reps) > 1 or n <= 2 * WHOLE_K + 1:
            return (_copy(self.whole),)
        return tuple(short_model(self.whole, self.layers, range(c)) for c in (WHOLE_K, WHOLE_K + 1))

    def models(self, parts: Sequence[tuple[Node, ...]]) -> tuple[list[BuiltModel], list[BuiltModel]]:
        """Meta copies of each anchor's short model and of the chained model of each part of the chain."""
        anchors = [short_model(self.whole, self.layers, picks) for picks in self.picks]
        lead, last = lead_picks(self.reps, self.ok), len(self.layers) - 1
        chained = [[*lead, *(self.reps[k] for k, _ in part), last] for part in parts]
        return anchors, [short_model(self.whole, self.layers, picks) for picks in chained]

    def profile(
        self,
        source: ModelSource,
        wl: Workload,
        base: StepRecord,
        n_params: int,
        records: dict[tuple[Any, ...], Site],
        seconds: float,
    ) -> Profile:
        lead = len(self.reps)
        members = [tuple(i for i, x in enumerate(self.kind_of) if x == k) for k in range(lead)]
        refused = [dict(r) for r in self.refused]
        ok = [list(o) for o in self.ok]
        for k in range(lead):  # what was measured to replay nothing is refused, not priced
            nothing = _replaying_nothing(_measured(records, k), ok[k])
            refused[k].update(nothing)
            ok[k] = [p for p in ok[k] if p not in nothing]
        kinds = tuple(
            _kind(self.labels[k], members[k], self.layers[self.reps[k]], k, records, refused[k]) for k in range(lead)
        )
        links = {f"{a}>{b}": _link(records, ("pair", a, b), ok[a], ok[b]) for a, b in self.pairs}
        last = _last(records, ok[self.kind_of[-1]])
        profiled = _assemble(source, self.whole, wl, base, kinds, self.kind_of, links, last, n_params, seconds)
        return dataclasses.replace(profiled, offload_shared=self.offload_shared(records, kinds))

    def offload_shared(self, records: dict[tuple[Any, ...], Site], kinds: Sequence[LayerKind]) -> int:
        """Host bytes offload copies once for all offloaded layers (``Profile.offload_shared``): what the chain's
        first offloaded leading layer keeps in host memory beyond what a layer of its kind does (it saves what
        the layers share first)."""
        chained = next((site.rec for key, site in records.items() if key[0] == "pair"), None)
        x = 0
        for k, names in enumerate(self.ok):
            for name in names:
                if chained is not None and name in OFFLOAD_POLICIES and name in kinds[k].host:
                    lead = sum(r.nbytes for r in chained.saved if r.layer == x and r.host)
                    return lead - kinds[k].host[name]
                x += 1
        return 0


def _copy(built: BuiltModel) -> BuiltModel:
    return BuiltModel(copy.deepcopy(built.model), built.loss_fn, built.vocab, built.class_name, built.notes)


def _refused(whole: BuiltModel, layers: nn.ModuleList, rep: int) -> dict[str, str]:
    """The policies layer ``rep`` cannot take, with the reason (``apply`` on a meta copy of it alone)."""
    out = {}
    for name in profiled_policies():
        try:
            apply(short_model(whole, layers, [rep]).model, name)
        except ConfigError as e:
            out[name] = first_line(e)
    return out


def _saved(record: StepRecord, layer: int) -> int:
    return sum(r.nbytes for r in record.saved if r.layer == layer)


def _peak(record: StepRecord, phase: Phase) -> int:
    return record.phase_peaks[phase][0] if phase in record.phase_peaks else 0


def _flops(record: StepRecord, phase: Phase) -> dict[str, int]:
    return dict(record.flops.get(phase, {}))


def _measured(records: dict[tuple[Any, ...], Site], k: int) -> dict[str, Site]:
    """Kind ``k``'s measured layer by its policy: at a generic position with the next layer under ``none`` (the
    next of the last kind to follow it), or, for a kind only last, with the head after it."""
    follow = [key for key in records if key[0] == "pair" and key[1] == k]
    if follow:
        b = max(key[2] for key in follow)
        found = {key[3]: v for key, v in records.items() if key[:3] == ("pair", k, b) and key[4] == "none"}
    else:
        found = {key[1]: v for key, v in records.items() if key[0] == "last"}
    return {name: found[name] for name in profiled_policies() if name in found}  # in the policies' order


def _replaying_nothing(mine: dict[str, Site], names: Sequence[str]) -> dict[str, str]:
    """The recomputing policies a layer was measured not to replay: its backward has no more FLOPs than under
    ``none`` (the policy did not reach what it wraps). Pricing them would price a replay that does not happen
    (Falcon's core_attn before ``apply`` refused it: 0 recompute FLOPs, its own eager attention run)."""
    plain = sum(_flops(mine["none"].rec, _layer(mine["none"], "backward")).values())
    return {
        name: "measured replaying nothing: the layer's backward has no more FLOPs than under none"
        for name in names
        if name not in ("none", *OFFLOAD_POLICIES)
        and name in mine
        and sum(_flops(mine[name].rec, _layer(mine[name], "backward")).values()) <= plain
    }


def _kind(
    label: str,
    members: tuple[int, ...],
    layer: nn.Module,
    k: int,
    records: dict[tuple[Any, ...], Site],
    refused: dict[str, str],
) -> LayerKind:
    """Kind ``k`` from the sites where a layer of it is measured at a generic position with the next layer under
    ``none`` (the next of the last kind to follow it), or, for a kind only last, with the head after it."""
    mine = {name: site for name, site in _measured(records, k).items() if name not in refused}
    ref = mine["none"]
    kept, held, comps, ops, d_f, d_b, b_flops, b_ops = {}, {}, {}, {}, {}, {}, {}, {}
    f_work, b_work, host, below = {}, {}, {}, {}
    for name, site in mine.items():
        rec, fwd, bwd = site.rec, _layer(site, "forward"), _layer(site, "backward")
        f_work[name] = work_list(rec.work.get(fwd, {}))
        b_work[name] = work_list(rec.work.get(bwd, {}))
        records_x = [r for r in rec.saved if r.layer == site.x and not r.host]
        kept[name] = sum(r.nbytes for r in records_x)
        host[name] = sum(r.nbytes for r in rec.saved if r.layer == site.x and r.host)
        below[name] = _below(site)
        held[name] = _held(site)
        comps[name] = _sum_by(records_x, "component")
        ops[name] = _sum_by(records_x, "op")
        d_f[name] = _phase_delta(site, ref, "forward")
        d_b[name] = _phase_delta(site, ref, "backward")
        b_ops[name] = _flops(rec, bwd)
        b_flops[name] = sum(b_ops[name].values())
    f_ops = _flops(ref.rec, _layer(ref, "forward"))
    return LayerKind(
        name=label,
        layers=members,
        parameters=sum(p.numel() for p in layer.parameters()),
        kept=kept,
        held=held,
        components=comps,
        ops=ops,
        forward_delta=d_f,
        backward_delta=d_b,
        forward_flops=sum(f_ops.values()),
        backward_flops=b_flops,
        forward_ops=f_ops,
        backward_ops=b_ops,
        forward_work=f_work,
        backward_work=b_work,
        refused=dict(refused),
        host=host,
        below=below,
    )


def _layer(site: Site, stage: str) -> Phase:
    return Phase(stage, "layer", site.x)


def _held(site: Site) -> int:
    """Growth of allocated bytes over the layer's forward: from its start to the next layer's (or the head's)."""
    rec, x = site.rec, site.x
    after = rec.layer_starts[x + 1] if x + 1 < len(rec.layer_starts) else _peak(rec, Phase("forward", "head"))
    return after - rec.layer_starts[x]


def _rise(site: Site, stage: str, part: str) -> int:
    """The peak of a phase (the layer's own, or the head's) above the memory at the layer's start, less the
    gradients of the layers beyond the next one in a backward phase, and less the copies back of what the layers
    below offloaded (a cost table adds the layer below's as its ``below``)."""
    phase = _layer(site, stage) if part == "layer" else Phase(stage, part)
    below = sum(v for j, v in site.rec.phase_fetched.get(phase, {}).items() if j < site.x)
    return _peak(site.rec, phase) - site.rec.layer_starts[site.x] - (site.above if stage == "backward" else 0) - below


def _below(site: Site) -> int:
    """Bytes of the layer's offloaded tensors back on the device at the peak of the next layer's backward (they
    come back when it starts, prefetched); 0 for the last layer, which has none after it."""
    after = Phase("backward", "layer", site.x + 1)
    return site.rec.phase_fetched.get(after, {}).get(site.x, 0) if site.x + 1 < site.rec.n_layers else 0


def _phase_delta(site: Site, ref: Site, stage: str, part: str = "layer") -> int:
    """A phase's rise (``_rise``) against the all-``none`` reference's."""
    return _rise(site, stage, part) - _rise(ref, stage, part)


def _link(
    records: dict[tuple[Any, ...], Site], tag: tuple[Any, ...], first: Sequence[str], then: Sequence[str]
) -> dict[str, dict[str, PairFigures]]:
    """Per (a layer's policy, the next one's): what it holds, its backward phase's and its forward phase's
    deltas, against both running ``none``."""
    ref_key: tuple[Any, ...] = (*tag, "none", "none")
    ref = records[ref_key]
    out: dict[str, dict[str, PairFigures]] = {}
    for p in first:
        out[p] = {}
        for q in then:
            key: tuple[Any, ...] = (*tag, p, q)
            site = records[key]
            out[p][q] = PairFigures(
                _held(site) - _held(ref),
                _phase_delta(site, ref, "backward"),
                _phase_delta(site, ref, "forward"),
            )
    return out


def _last(records: dict[tuple[Any, ...], Site], policies: Sequence[str]) -> dict[str, LastFigures]:
    """For the last layer, per policy: its backward phase's delta and the head's forward and backward deltas,
    against ``none``."""
    ref = records["last", "none"]
    out = {}
    for p in policies:
        site = records["last", p]
        out[p] = LastFigures(
            _phase_delta(site, ref, "backward"),
            _phase_delta(site, ref, "forward", "head"),
            _phase_delta(site, ref, "backward", "head"),
        )
    return out


def _sum_by(records: Sequence[Any], attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[getattr(r, attr)] = out.get(getattr(r, attr), 0) + r.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _assemble(
    source: ModelSource,
    whole: BuiltModel,
    wl: Workload,
    base: StepRecord,
    kinds: tuple[LayerKind, ...],
    kind_of: tuple[int, ...],
    links: dict[str, dict[str, dict[str, PairFigures]]],
    last: dict[str, LastFigures],
    n_params: int,
    seconds: float,
) -> Profile:
    n = len(kind_of)
    layer_phases = {Phase(s, "layer", i) for s in ("forward", "backward") for i in range(n)}
    head = {Phase("forward", "head"), Phase("backward", "head")}
    fixed = {str(ph): v for ph, (v, _) in base.phase_peaks.items() if ph not in layer_phases | head}
    st = base.states
    key = profile_key(source, wl) or f"factory {source.origin}"
    notes = [
        f"profiled {whole.class_name} built from {source.origin} {fake_device_note(wl.device)}: exact sizes, "
        "nothing allocated",
        *whole.notes,
        f"{len(kinds)} kind{'s' if len(kinds) != 1 else ''} of layer: "
        + "; ".join(f"{k.name} ({ranges(k.layers)})" for k in kinds),
    ]
    dense = all(name in k.refused for k in kinds for name in MOE_POLICIES)
    for k in kinds:
        for name, why in k.refused.items():
            if not (dense and name in MOE_POLICIES):  # a dense model has no experts: nothing to say
                notes.append(f"{name} does not apply to {k.name}: {why}")
    return Profile(
        model=source.name,
        origin=source.origin,
        class_name=whole.class_name,
        key=key,
        workload={
            **{k: getattr(wl, k) for k in store.MEASURED_WORKLOAD},
            **({"precision": AMP} if wl.precision == AMP else {}),  # a step of its own (its states: Profile.restated)
            **({"fsdp": True, "dp": wl.dp, "precision": wl.precision} if wl.fsdp else {}),  # one FSDP rank as it is
        },
        kinds=kinds,
        layer_kind=kind_of,
        links=links,
        last=last,
        base_kept=tuple(_saved(base, i) for i in range(n)),
        base_forward=tuple(_peak(base, Phase("forward", "layer", i)) for i in range(n)),
        base_backward=tuple(_peak(base, Phase("backward", "layer", i)) for i in range(n)),
        head_forward=_peak(base, Phase("forward", "head")),
        head_backward=_peak(base, Phase("backward", "head")),
        fixed=fixed,
        phase_states={
            str(ph): (parts.get("Gradient", 0), parts.get("Temp", 0)) for ph, (_, parts) in base.phase_peaks.items()
        },
        parameters=st.get("Parameter", 0),
        gradients=st.get("Gradient", 0),
        optimizer=st.get("Optstate", 0),
        other=st.get("Buffer", 0) + st.get("Other", 0),
        parameter_count=n_params,
        embedding_kept=_saved(base, -1),
        head_kept=_saved(base, -2),
        step_flops=sum(sum(ops.values()) for ph, ops in base.flops.items() if ph.stage != "optimizer"),
        outer_work={
            str(ph): work_list(w)
            for ph, w in sorted(base.work.items(), key=lambda kv: kv[0].order())
            if ph not in layer_phases
        },
        tokens=wl.micro_batch * wl.seq_len,
        notes=tuple(notes),
        versions=store.library_versions(),
        seconds=seconds,
        model_hash=model_identity(whole.model, name=source.name).hash,
    )

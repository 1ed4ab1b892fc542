"""``profile(model, workload)``: measure a ``Profile`` (``recompute.core.profile``) on fake tensors of the real class.

Two kinds of step, both traced like ``trace`` (nothing allocated):

1. the whole model under ``none``: every layer's forward and backward peak, what each keeps, the head's and
   the fixed phases, the model states and the step's FLOPs;
2. per pair of kinds that follow each other in the model, and per pair of policies (the layer's, the next
   one's), a short model: a copy of the first layer of each kind under the layer's policy where it applies
   (so what layers share, such as rotary tables or one attention type's mask, is kept by those, as by the
   first such layer in the whole model), the measured layer and the one after it (taken from the whole
   model with their own settings: attention type, dense or MoE MLP), and a copy of the last layer. A
   layer's backward depends on how the next one hands it the gradient, so its figures are measured per
   policy of the next layer; the last layer's, per policy, with the head after it. A policy a layer cannot
   take is recorded with its reason.

What a layer adds to the memory the backward inherits is measured as the growth of allocated bytes from the
start of its forward to the start of the next one's: that counts what it saves, what a checkpoint holds by
reference, and its input freed when nothing keeps it. Saved-tensor bytes alone would not add up: a storage
two layers need is counted once, by whichever saves it first.

Layers are of one kind when they have the same class, parameters, attention type and settings
(``_kinds.layer_kinds``); they are never assumed alike otherwise.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from recompute.checkpointing import apply, find_layers
from recompute.core import policy as policies
from recompute.core.errors import ConfigError, first_line, require
from recompute.core.policy import OFFLOAD_POLICIES, POLICIES, Policy
from recompute.core.profile import (
    PROFILED_WORKLOAD,
    LayerKind,
    Profile,
    cache_key,
    cache_path,
    cached,
    library_versions,
)
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec
from recompute.core.timing import work_list
from recompute.core.workload import Workload
from recompute.models.source import BuiltModel, ModelSource
from recompute.runtime import TORCH_DTYPES, resolve_device
from recompute.trace._build import build_meta, fake_kernels
from recompute.trace._kinds import layer_kinds, ranges, short_model
from recompute.trace._run import _check_traceable, _source_of, step_built
from recompute.trace._step import StepRecord
from recompute.trace._tracker import Phase

__all__ = ["cached_profile", "profile", "profile_key"]


def profiled_policies() -> tuple[str, ...]:
    """Every policy name ``apply`` knows (a policy a layer cannot take is recorded as refused)."""
    return (*POLICIES, *getattr(policies, "MOE_POLICIES", {}))


def profile_key(source: ModelSource, wl: Workload) -> str | None:
    """The cache key of ``source`` at ``wl``; None for a factory (its code is not a config to hash)."""
    if source.raw is not None:
        ident: dict[str, Any] = {"config": source.raw}
    elif source.spec is not None:
        ident = {"spec": source.spec.to_dict() if hasattr(source.spec, "to_dict") else repr(source.spec)}
        ident["hf"] = source.hf
    else:
        return None
    return cache_key(ident, wl.to_dict())


def cached_profile(
    model: ModelSpec | ModelSource | str, wl: Workload, *, progress: Progress = no_progress
) -> tuple[Profile, bool]:
    """The profile of ``model`` at ``wl`` from the cache, or measured now and cached; and whether it was cached."""
    source = _source_of(model, False)
    key = profile_key(source, wl)
    found = cached(key) if key else None
    if found is not None:
        return found, True
    result = profile(source, wl, progress=progress)
    if key:
        result.save(cache_path(key))
    return result, False


def profile(model: ModelSpec | ModelSource | str, wl: Workload, *, progress: Progress = no_progress) -> Profile:
    """Measure ``model``'s profile at ``wl`` (see the module docstring).

    Raises:
        ConfigError: as ``trace``; and parallelism (a profile is of one device: use ``--analytic`` estimates).
    """
    source = _source_of(model, False)
    require(
        wl.tp == wl.pp == wl.dp == 1,
        "a profile measures one device's step; drop tp, pp and dp (recompute estimate --analytic models them)",
        fields=("tp", "pp", "dp"),
    )
    _check_traceable(source, wl)
    device = resolve_device(wl.device)
    dtype = TORCH_DTYPES[wl.dtype]
    start = time.perf_counter()
    with fake_kernels():
        whole = build_meta(source, attention=wl.attention, dtype=dtype)
        layers = find_layers(whole.model)
        found = layer_kinds(whole.model, layers)
        kind_of, reps, labels = list(found.kind_of), list(found.reps), found.labels
        n, lead = len(layers), len(reps)
        refused = [_refused(whole, layers, r) for r in reps]
        ok = [[p for p in profiled_policies() if p not in refused[k]] for k in range(lead)]
        pairs = sorted({(kind_of[i], kind_of[i + 1]) for i in range(n - 1)})
        runs: list[tuple[tuple[Any, ...], list[int], int, tuple[str, ...]]] = []

        def leads(p: str) -> tuple[str, ...]:
            """The leading layers run the measured layer's policy where they take it: what layers share is
            then kept by them under that policy, as by the model's first layers when every layer runs it."""
            return tuple(p if p in ok[k] else "none" for k in range(lead))

        for a, b in pairs:  # a layer of kind a at a generic position, followed by one of kind b
            picks = [*reps, reps[a], reps[b], n - 1]
            runs += [(("pair", a, b, p, q), picks, lead, (*leads(p), p, q, "none")) for p in ok[a] for q in ok[b]]
        picks = [*reps, n - 1] if n > 1 else [0]  # the last layer, with the head after it
        x_last = len(picks) - 1
        runs += [(("last", p), picks, x_last, (*leads(p)[:x_last], p)) for p in ok[kind_of[-1]]]
        shorts = {tuple(picks): short_model(whole, layers, picks) for _, picks, _, _ in runs}  # while on meta
        progress("profile", 0, len(runs) + 1)
        base, _, n_params = step_built(whole, wl, Policy("none"), device=device, flops=True)
        progress("profile", 1, len(runs) + 1)
        records: dict[tuple[Any, ...], tuple[StepRecord, int]] = {}
        for j, (key, picks, x, per_layer) in enumerate(runs):
            built = _copy(shorts[tuple(picks)])
            records[key] = step_built(built, wl, Policy(layers=per_layer), device=device, flops=True)[0], x
            progress("profile", j + 2, len(runs) + 1)
    for k in range(lead):
        refused[k].update(_replaying_nothing(records, k, ok[k]))
        ok[k] = [p for p in ok[k] if p not in refused[k]]
    kinds = tuple(_kind(labels[k], found.members(k), layers[reps[k]], k, records, refused[k]) for k in range(lead))
    links = {f"{a}>{b}": _link(records, ("pair", a, b), ok[a], ok[b]) for a, b in pairs}
    last = _last(records, ok[kind_of[-1]])
    return _assemble(source, whole, wl, base, kinds, tuple(kind_of), links, last, n_params, time.perf_counter() - start)


def _refused(whole: BuiltModel, layers: nn.ModuleList, rep: int) -> dict[str, str]:
    """The policies layer ``rep`` cannot take, with the reason (``apply`` on a meta copy of it alone)."""
    out = {}
    for name in profiled_policies():
        try:
            apply(short_model(whole, layers, [rep]).model, name)
        except ConfigError as e:
            out[name] = first_line(e)
    return out


def _replaying_nothing(
    records: dict[tuple[Any, ...], tuple[StepRecord, int]], k: int, names: Sequence[str]
) -> dict[str, str]:
    """The recomputing policies a layer of kind ``k`` was measured not to replay: its backward has no more FLOPs
    than under ``none`` (the policy did not reach what it wraps). Pricing them would price a replay that does not
    happen (Falcon's core_attn before ``apply`` refused it: 0 recompute FLOPs, its own eager attention run)."""
    mine = _measured(records, k)
    ref, x = mine["none"]
    backward = Phase("backward", "layer", x)
    plain = sum(_flops(ref, backward).values())
    return {
        name: "measured replaying nothing: the layer's backward has no more FLOPs than under none"
        for name in names
        if name not in ("none", *OFFLOAD_POLICIES)
        and name in mine
        and sum(_flops(mine[name][0], backward).values()) <= plain
    }


def _measured(records: dict[tuple[Any, ...], tuple[StepRecord, int]], k: int) -> dict[str, tuple[StepRecord, int]]:
    """Kind ``k``'s measured layer by its policy, with the next layer under ``none`` (or the head after it)."""
    mine = {key[3]: v for key, v in records.items() if key[0] == "pair" and key[1] == k and key[4] == "none"}
    return mine or {key[1]: v for key, v in records.items() if key[0] == "last"}


def _copy(built: BuiltModel) -> BuiltModel:
    return BuiltModel(copy.deepcopy(built.model), built.loss_fn, built.vocab, built.class_name, built.notes)


def _saved(record: StepRecord, layer: int) -> int:
    return sum(r.nbytes for r in record.saved if r.layer == layer)


def _peak(record: StepRecord, phase: Phase) -> int:
    return record.phase_peaks[phase][0] if phase in record.phase_peaks else 0


def _flops(record: StepRecord, phase: Phase) -> dict[str, int]:
    return dict(record.flops.get(phase, {}))


def _kind(
    label: str,
    members: tuple[int, ...],
    layer: nn.Module,
    k: int,
    records: dict[tuple[Any, ...], tuple[StepRecord, int]],
    refused: dict[str, str],
) -> LayerKind:
    """Kind ``k`` from the short models where a layer of it is measured at a generic position with the next
    layer under ``none`` (or, for a kind only last, the head after it)."""
    mine = {name: v for name, v in _measured(records, k).items() if name not in refused}
    ref, x = mine["none"]
    fwd, bwd = Phase("forward", "layer", x), Phase("backward", "layer", x)
    kept, held, comps, ops, d_f, d_b, b_flops, b_ops = {}, {}, {}, {}, {}, {}, {}, {}
    f_work, b_work = {}, {}
    for name, (rec, _) in mine.items():
        f_work[name] = work_list(rec.work.get(fwd, {}))
        b_work[name] = work_list(rec.work.get(bwd, {}))
        records_x = [r for r in rec.saved if r.layer == x]
        kept[name] = sum(r.nbytes for r in records_x)
        held[name] = _held(rec, x)
        comps[name] = _sum_by(records_x, "component")
        ops[name] = _sum_by(records_x, "op")
        d_f[name] = _phase_delta(rec, ref, fwd, x)
        d_b[name] = _phase_delta(rec, ref, bwd, x)
        b_ops[name] = _flops(rec, bwd)
        b_flops[name] = sum(b_ops[name].values())
    f_ops = _flops(ref, fwd)
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
    )


def _held(rec: StepRecord, x: int) -> int:
    """Growth of allocated bytes over layer ``x``'s forward: from its start to the next layer's (or the head's)."""
    after = rec.layer_starts[x + 1] if x + 1 < len(rec.layer_starts) else _peak(rec, Phase("forward", "head"))
    return after - rec.layer_starts[x]


def _phase_delta(rec: StepRecord, ref: StepRecord, phase: Phase, x: int) -> int:
    """The peak of ``phase`` above the memory at layer ``x``'s start, against the all-``none`` reference."""
    return (_peak(rec, phase) - rec.layer_starts[x]) - (_peak(ref, phase) - ref.layer_starts[x])


def _link(
    records: dict[tuple[Any, ...], tuple[StepRecord, int]],
    tag: tuple[Any, ...],
    first: Sequence[str],
    then: Sequence[str],
) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per (a layer's policy, the next one's): what it holds, its backward phase's and its forward phase's
    deltas, against both running ``none``."""
    ref_key: tuple[Any, ...] = (*tag, "none", "none")
    ref, x = records[ref_key]
    fwd, bwd = Phase("forward", "layer", x), Phase("backward", "layer", x)
    out: dict[str, dict[str, tuple[int, int, int]]] = {}
    for p in first:
        out[p] = {}
        for q in then:
            key: tuple[Any, ...] = (*tag, p, q)
            rec, _ = records[key]
            out[p][q] = (
                _held(rec, x) - _held(ref, x),
                _phase_delta(rec, ref, bwd, x),
                _phase_delta(rec, ref, fwd, x),
            )
    return out


def _last(
    records: dict[tuple[Any, ...], tuple[StepRecord, int]], policies: Sequence[str]
) -> dict[str, tuple[int, int, int]]:
    """For the last layer, per policy: its backward phase's delta and the head's forward and backward deltas,
    against ``none``."""
    ref, x = records["last", "none"]
    out = {}
    for p in policies:
        rec, _ = records["last", p]
        out[p] = (
            _phase_delta(rec, ref, Phase("backward", "layer", x), x),
            _phase_delta(rec, ref, Phase("forward", "head"), x),
            _phase_delta(rec, ref, Phase("backward", "head"), x),
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
    links: dict[str, dict[str, dict[str, tuple[int, int, int]]]],
    last: dict[str, tuple[int, int, int]],
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
        f"profiled {whole.class_name} built from {source.origin} on fake {wl.device} tensors: exact sizes, "
        "nothing allocated",
        *whole.notes,
        f"{len(kinds)} kind{'s' if len(kinds) != 1 else ''} of layer: "
        + "; ".join(f"{k.name} ({ranges(k.layers)})" for k in kinds),
    ]
    for k in kinds:
        for name, why in k.refused.items():
            notes.append(f"{name} does not apply to {k.name}: {why}")
    return Profile(
        model=source.name,
        origin=source.origin,
        class_name=whole.class_name,
        key=key,
        workload={k: getattr(wl, k) for k in PROFILED_WORKLOAD},
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
        versions=library_versions(),
        seconds=seconds,
    )

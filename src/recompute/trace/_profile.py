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

Layers are of one kind when they have the same class, the same parameters (names and shapes) and the same
attention type; they are never assumed alike otherwise.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from recompute.checkpointing import apply, find_layers
from recompute.core import policy as policies
from recompute.core.errors import ConfigError, first_line, require
from recompute.core.policy import POLICIES, Policy
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
        kind_of, reps, labels = _layer_kinds(whole.model, layers)
        n, lead = len(layers), len(reps)
        refused = [_refused(whole, layers, r) for r in reps]
        ok = [[p for p in profiled_policies() if p not in refused[k]] for k in range(lead)]
        pairs = sorted({(kind_of[i], kind_of[i + 1]) for i in range(n - 1)})
        chain = _chain(pairs, ok)
        lasts = ok[kind_of[-1]]
        x_last = lead if n > 1 else 0
        # The last layer with the head after it, per policy; and for a policy the chain runs but the last layer
        # cannot take, a layer of a kind that takes it after the leading layers (what the layers share that
        # they keep, for ``_chain_sites``).
        anchors = [("last", p, [*reps, n - 1] if n > 1 else [0], x_last) for p in lasts]
        for p in dict.fromkeys(p for _, p in chain):
            if p not in lasts:
                k = next(k for k in range(lead) if p in ok[k])
                anchors.append(("alone", p, [*reps, reps[k]], lead))
        steps = 2 + len(anchors)
        # Built while the whole model is on meta: a step makes its model fake in place.
        shorts = [_short_model(whole, layers, picks) for _, _, picks, _ in anchors]
        leads = [p for k in range(lead) for p in ok[k]]
        long = _short_model(whole, layers, [*_lead_picks(reps, ok), *(reps[k] for k, _ in chain), n - 1])
        progress("profile", 0, steps)
        base, _, n_params = step_built(whole, wl, Policy("none"), device=device, flops=True)
        progress("profile", 1, steps)
        records: dict[tuple[Any, ...], _Site] = {}
        only_last = any(k not in {a for a, _ in pairs} for k in range(lead))  # its figures come from the last runs
        shared: dict[str, int] = {}
        for j, ((tag, p, _, x), built) in enumerate(zip(anchors, shorts)):
            per_layer = (*_leads(p, ok)[:x], p)
            rec = step_built(
                built, wl, Policy(layers=per_layer), device=device, flops=only_last, step=False, owners=True
            )[0]
            records[tag, p] = _Site(rec, x)
            shared[p] = rec.phase_shared.get(Phase("backward", "layer", x), 0)
            progress("profile", j + 2, steps)
        if chain:
            per_layer = (*leads, *(p for _, p in chain), "none")
            rec = step_built(long, wl, Policy(layers=per_layer), device=device, flops=True, step=False, owners=True)[0]
            records |= _chain_sites(rec, chain, len(leads), set(pairs), shared)
        progress("profile", steps, steps)
    members = [tuple(i for i, x in enumerate(kind_of) if x == k) for k in range(lead)]
    kinds = tuple(_kind(labels[k], members[k], layers[reps[k]], k, records, refused[k]) for k in range(lead))
    links = {f"{a}>{b}": _link(records, ("pair", a, b), ok[a], ok[b]) for a, b in pairs}
    last = _last(records, lasts)
    return _assemble(source, whole, wl, base, kinds, tuple(kind_of), links, last, n_params, time.perf_counter() - start)


def _leads(p: str, ok: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The leading layers (the first of each kind) run ``p`` where they take it: what layers share is then kept
    by them under that policy, as by the model's first layers when every layer runs it."""
    return tuple(p if p in ok[k] else "none" for k in range(len(ok)))


def _lead_picks(reps: Sequence[int], ok: Sequence[Sequence[str]]) -> list[int]:
    """The chain's leading layers: the first layer of each kind once per policy it takes, so that whatever the
    layers share is kept by one of them under every policy, before any measured layer."""
    return [reps[k] for k in range(len(reps)) for _ in ok[k]]


@dataclass(frozen=True)
class _Site:
    """A layer measured in a step: the step's record, the layer's index in it, and what the layers beyond the
    one after it leave allocated through its backward (their gradients, what their forward keeps to the end of
    the step): a short model has none of them."""

    rec: StepRecord
    x: int
    above: int = 0


def _chain(pairs: Sequence[tuple[int, int]], ok: Sequence[Sequence[str]]) -> list[tuple[int, str]]:
    """Layers as (kind, policy) in an order in which every measured transition (a layer of kind a under p, then
    one of kind b under q, for each pair of kinds (a, b) that follow each other in the model) occurs.

    Note: [one step for every link] A layer's figures depend on its own policy and the next layer's, not on
    where it stands (given the gradients of the layers above, which ``_Site.above`` takes off) nor on the
    layers before it (given what they share is kept before it: ``_lead_picks``). So the links are measured in
    one model whose layers walk an Euler path through the graph of transitions (Hierholzer): about one layer per
    transition instead of a short model of four layers each. Where the graph is unbalanced or falls apart,
    transitions no link needs are added (a layer each). tests/test_profile.py holds the result to short models
    of each transition alone.
    """
    adj: dict[tuple[int, str], list[tuple[int, str]]] = {}
    surplus: dict[tuple[int, str], int] = {}  # edges out minus edges in
    for a, b in pairs:
        for p in ok[a]:
            for q in ok[b]:
                adj.setdefault((a, p), []).append((b, q))
                adj.setdefault((b, q), [])
                surplus[a, p] = surplus.get((a, p), 0) + 1
                surplus[b, q] = surplus.get((b, q), 0) - 1
    needs_out = [v for v in adj for _ in range(-surplus.get(v, 0))]
    needs_in = [v for v in adj for _ in range(surplus.get(v, 0))]
    for u, v in zip(needs_out, needs_in):
        adj[u].append(v)
    for v in adj:
        adj[v].reverse()  # popped from the end: in the order added
    chain: list[tuple[int, str]] = []
    for v in list(adj):
        if adj[v]:
            chain += _circuit(v, adj)
    return chain


def _circuit(start: tuple[int, str], adj: dict[tuple[int, str], list[tuple[int, str]]]) -> list[tuple[int, str]]:
    """Hierholzer's walk from ``start`` over every edge of its (balanced) component, consuming them."""
    stack, path = [start], []
    while stack:
        v = stack[-1]
        if adj[v]:
            stack.append(adj[v].pop())
        else:
            path.append(stack.pop())
    return path[::-1]


def _chain_sites(
    rec: StepRecord,
    chain: Sequence[tuple[int, str]],
    first: int,
    pairs: set[tuple[int, int]],
    shared: dict[str, int],
) -> dict[tuple[Any, ...], _Site]:
    """Every transition of ``chain`` (its layers from ``first`` on, then a copy of the model's last layer) as a
    ``("pair", a, b, p, q)`` site; the first occurrence of each.

    Note: [what the layers share] Tensors the model makes before its first layer (position ids, masks) live
    through the backward as long as a layer below keeps them (a checkpoint's inputs). In a short model the
    layers below a measured one run its policy, so a layer's backward is measured with what its policy keeps
    of them; the chain's leading layers keep all of it. ``shared[p]``, measured in an anchor whose leading
    layers run ``p``, puts the short model's amount back."""
    out: dict[tuple[Any, ...], _Site] = {}
    left = [g + a for g, a in zip(rec.layer_grads, rec.layer_left)]
    for i in range(len(chain) - 1):
        (a, p), (b, q) = chain[i], chain[i + 1]
        key = ("pair", a, b, p, q)
        x = first + i
        if (a, b) in pairs and key not in out:
            here = rec.phase_shared.get(Phase("backward", "layer", x), 0)
            out[key] = _Site(rec, x, sum(left[x + 2 :]) + here - shared[p])
    return out


def _refused(whole: BuiltModel, layers: nn.ModuleList, rep: int) -> dict[str, str]:
    """The policies layer ``rep`` cannot take, with the reason (``apply`` on a meta copy of it alone)."""
    out = {}
    for name in profiled_policies():
        try:
            apply(_short_model(whole, layers, [rep]).model, name)
        except ConfigError as e:
            out[name] = first_line(e)
    return out


def _layer_kinds(model: nn.Module, layers: nn.ModuleList) -> tuple[list[int], list[int], list[str]]:
    """Each layer's kind (index), the first layer of each kind, and each kind in words."""
    types = _layer_types(model, len(layers))
    signatures: dict[Any, int] = {}
    kind_of: list[int] = []
    reps: list[int] = []
    labels: list[str] = []
    for i, layer in enumerate(layers):
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
        attention = types[i] if types else getattr(layer, "attention_type", None)
        sig = (type(layer).__name__, params, str(attention))
        if sig not in signatures:
            signatures[sig] = len(reps)
            reps.append(i)
            labels.append(_label(layer, attention))
        kind_of.append(signatures[sig])
    return kind_of, reps, labels


def _layer_types(model: nn.Module, n: int) -> list[str] | None:
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return list(types)[:n] if isinstance(types, (list, tuple)) and len(types) >= n else None


def _label(layer: nn.Module, attention: Any) -> str:
    mlp = next(
        (type(m).__name__ for name, m in layer.named_children() if any(k in name for k in ("mlp", "moe", "ffn"))),
        None,
    )
    parts = [type(layer).__name__]
    if attention:
        parts.append(str(attention))
    if mlp:
        parts.append(mlp)
    return ", ".join(parts)


def _short_model(whole: BuiltModel, layers: nn.ModuleList, picks: Sequence[int]) -> BuiltModel:
    """A meta copy of the model whose layers are copies of ``layers[i]`` for each ``i`` in ``picks``, in order."""
    model = whole.model
    parent, attr = _owner(model, layers)
    path = next(name for name, m in model.named_modules() if m is parent)
    setattr(parent, attr, nn.ModuleList())  # deepcopy the rest of the model without the whole layer list
    try:
        short = copy.deepcopy(model)
    finally:
        setattr(parent, attr, layers)
    copies = nn.ModuleList(copy.deepcopy(layers[i]) for i in picks)
    for position, layer in enumerate(copies):
        for m in layer.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.__dict__["layer_idx"] = position  # transformers' KV cache is indexed by it during the forward
    setattr(short.get_submodule(path), attr, copies)
    config = getattr(short, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        types = _layer_types(model, len(layers))
        config.num_hidden_layers = len(picks)
        if types:
            config.layer_types = [types[i] for i in picks]
    return BuiltModel(short, whole.loss_fn, whole.vocab, whole.class_name, whole.notes)


def _owner(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, child in module.named_children():
            if child is target:
                return module, name
    raise ConfigError(f"cannot find the layer list in {type(model).__name__}")


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
    records: dict[tuple[Any, ...], _Site],
    refused: dict[str, str],
) -> LayerKind:
    """Kind ``k`` from the sites where a layer of it is measured at a generic position with the next layer under
    ``none`` (the next of the last kind to follow it), or, for a kind only last, with the head after it."""
    follow = [key for key in records if key[0] == "pair" and key[1] == k]
    if follow:
        b = max(key[2] for key in follow)
        mine = {key[3]: v for key, v in records.items() if key[:3] == ("pair", k, b) and key[4] == "none"}
    else:
        mine = {key[1]: v for key, v in records.items() if key[0] == "last"}
    ref = mine["none"]
    kept, held, comps, ops, d_f, d_b, b_flops, b_ops = {}, {}, {}, {}, {}, {}, {}, {}
    f_work, b_work = {}, {}
    for name, site in mine.items():
        rec, fwd, bwd = site.rec, _layer(site, "forward"), _layer(site, "backward")
        f_work[name] = work_list(rec.work.get(fwd, {}))
        b_work[name] = work_list(rec.work.get(bwd, {}))
        records_x = [r for r in rec.saved if r.layer == site.x]
        kept[name] = sum(r.nbytes for r in records_x)
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
    )


def _layer(site: _Site, stage: str) -> Phase:
    return Phase(stage, "layer", site.x)


def _held(site: _Site) -> int:
    """Growth of allocated bytes over the layer's forward: from its start to the next layer's (or the head's)."""
    rec, x = site.rec, site.x
    after = rec.layer_starts[x + 1] if x + 1 < len(rec.layer_starts) else _peak(rec, Phase("forward", "head"))
    return after - rec.layer_starts[x]


def _rise(site: _Site, stage: str, part: str) -> int:
    """The peak of a phase (the layer's own, or the head's) above the memory at the layer's start, less the
    gradients of the layers beyond the next one in a backward phase."""
    phase = _layer(site, stage) if part == "layer" else Phase(stage, part)
    return _peak(site.rec, phase) - site.rec.layer_starts[site.x] - (site.above if stage == "backward" else 0)


def _phase_delta(site: _Site, ref: _Site, stage: str, part: str = "layer") -> int:
    """A phase's rise (``_rise``) against the all-``none`` reference's."""
    return _rise(site, stage, part) - _rise(ref, stage, part)


def _link(
    records: dict[tuple[Any, ...], _Site], tag: tuple[Any, ...], first: Sequence[str], then: Sequence[str]
) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per (a layer's policy, the next one's): what it holds, its backward phase's and its forward phase's
    deltas, against both running ``none``."""
    ref = records[(*tag, "none", "none")]
    out: dict[str, dict[str, tuple[int, int, int]]] = {}
    for p in first:
        out[p] = {}
        for q in then:
            site = records[(*tag, p, q)]
            out[p][q] = (
                _held(site) - _held(ref),
                _phase_delta(site, ref, "backward"),
                _phase_delta(site, ref, "forward"),
            )
    return out


def _last(records: dict[tuple[Any, ...], _Site], policies: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """For the last layer, per policy: its backward phase's delta and the head's forward and backward deltas,
    against ``none``."""
    ref = records["last", "none"]
    out = {}
    for p in policies:
        site = records["last", p]
        out[p] = (
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
        + "; ".join(f"{k.name} ({_ranges(k.layers)})" for k in kinds),
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


def _ranges(layers: Sequence[int]) -> str:
    """``0-3, 5, 7-9``."""
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return "layers " + ", ".join(out)

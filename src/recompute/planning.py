"""From a model and a workload to what the planner reads: the model's cost table in each loss mode, priced.

A preset (or any model with ``analytic``) gets the analytic model's table (``recompute.core.analytic.table``);
any other model (a transformers config.json, a ``module:factory``) the table of its profile, the real class
measured on fake tensors (``recompute.trace.profile``). Costs are recomputed FLOPs, predicted seconds on a
device (``recompute.core.pricing``: the uniform policies' traced step work for a preset, the profile's per-kind
work otherwise), or a ``recompute bench`` result's measured seconds. What has been measured before comes from
the store (``recompute.core.store``) without torch; only something missing loads the torch floor
(``recompute.trace``) to measure it. ``plan``, ``estimate`` and ``report`` all come through here.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from recompute.core import store
from recompute.core.analytic.memory import layer_activations
from recompute.core.analytic.table import analytic_table, with_loss
from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError, first_line, require
from recompute.core.files import config_named, is_path
from recompute.core.identity import ModelId, spec_id
from recompute.core.plan import smallest_achievable
from recompute.core.policy import POLICIES
from recompute.core.presets import PRESETS
from recompute.core.pricing import (
    Job,
    host_link,
    layer_costs,
    measured_costs,
    network_notes,
    offload_layer_seconds,
    profile_offload_seconds,
    scheduled_profile_table,
    unpriced,
    unpriced_offload,
    with_expert_parallelism,
)
from recompute.core.profile import Profile
from recompute.core.progress import Progress, no_progress
from recompute.core.spec import ModelSpec, analytic_model, hf_config_dict
from recompute.core.timing import Device, StepWork
from recompute.core.workload import AMP, Workload, one_device, parallel_sizes

__all__ = [
    "ModelTables",
    "cost_tables",
    "is_profiled",
    "max_positions",
    "model_works",
    "preset_works",
    "profiles_of",
    "shown_offload",
]

FP16_CHUNKED = "in fp16 its gradients, taken in the forward before a loss scaler scales them, would underflow"
"""Why the chunked loss is not weighed under fp16."""


@dataclass(frozen=True)
class ModelTables:
    """A model's cost tables (the workload's own loss mode first) and what planning it needs besides."""

    tables: tuple[CostTable, ...]
    spec: ModelSpec | None
    """The spec the analytic model read (a preset, or any model with ``analytic``); None for a profile."""
    profiles: tuple[Profile, ...] = ()
    """The measured profiles the tables come from, one per loss mode."""
    notes: tuple[str, ...] = ()
    """What was left out and why (offload unpriced, the chunked loss under fp16, time not predicted)."""
    alternatives: Callable[[Workload], float | None] | None = None
    """The smallest achievable peak at another workload, where it is known without measuring."""
    model: ModelId | None = None
    """The model the tables are of, by name and architecture hash (``recompute.core.identity``)."""

    @property
    def device(self) -> dict[str, Any] | None:
        return self.tables[0].device


def is_profiled(
    model: str | Any,
    *,
    analytic: bool = False,
    profile: str | None = None,
    precision: str | None = None,
    fsdp: bool = False,
) -> bool:
    """Whether ``model`` (a name, or a ``ModelSource``) is planned from a measured profile: anything but a
    preset, unless ``analytic``; a preset too under ``precision`` amp, whose activations autocast decides (the
    formulas describe one dtype: ``recompute.core.analytic.memory.check_one_dtype``), and under ``fsdp``, whose
    rank is traced as it is (the formulas' FSDP terms are approximate: ``recompute.core.analytic.sharding``)."""
    require(not (analytic and profile), "--analytic and --profile exclude each other; drop one")
    preset = isinstance(model, str) and model in PRESETS
    return profile is not None or (not analytic and (not preset or precision == AMP or fsdp))


def max_positions(model: str) -> int | None:
    """The longest sequence ``model`` takes, read without torch: a preset's, or a config.json's
    ``max_position_embeddings`` (None for a factory, or a config that does not say)."""
    name = model.removeprefix("hf:")
    if name in PRESETS:
        return ModelSpec.from_name(name).max_positions
    if is_path(model):
        raw = hf_config_dict(model)
        found = raw.get("max_position_embeddings") or raw.get("n_positions")
        return int(found) if isinstance(found, int) and found > 0 else None
    return None


def cost_tables(
    model: str | Any,
    wl: Workload,
    *,
    device: Device | None = None,
    measured: str | Path | None = None,
    losses: Sequence[str] = (),
    offload: bool = False,
    analytic: bool = False,
    profile: str | Path | None = None,
    progress: Progress = no_progress,
) -> ModelTables:
    """The cost tables of ``model`` (a name as ``--model`` takes, or a ``ModelSource``) at ``wl`` in its own loss
    mode and each other one in ``losses``.

    Args:
        device: price in predicted seconds on this device (None: recomputed FLOPs).
        measured: price in the measured step times of this ``recompute bench --json`` result (a preset).
        offload: weigh offloading a layer where its copy time can be priced.
        analytic: the analytic model even for a model that is not a preset.
        profile: a ``recompute profile -o`` file to plan from, at its own workload.

    Raises:
        ConfigError: the model or the workload is refused, or a file is unreadable.
    """
    modes = list(dict.fromkeys((wl.loss, *losses)))
    notes: list[str] = []
    if "chunked" in modes and wl.dtype == "fp16" and wl.loss != "chunked":
        modes.remove("chunked")
        notes.append(f"the chunked loss not considered: {FP16_CHUNKED}")
    given = str(profile) if profile else None
    if is_profiled(model, analytic=analytic, profile=given, precision=wl.precision, fsdp=wl.fsdp):
        require(  # it was dropped: the plan came out in FLOPs, exit 0
            measured is None,
            "--cost measured prices a preset by its bench results; a profiled model is priced by predicted time "
            "(--cost time) or FLOPs (--cost flops)",
            fields=("cost",),
        )
        found = _profiled(model, wl, modes, device, offload, profile, progress, notes)
    else:
        found = _analytic(model, analytic_model(model), wl, modes, device, measured, offload, progress, notes)
    return _identified(found, model, profile is not None)


def _identified(found: ModelTables, model: str, from_file: bool) -> ModelTables:
    """``found`` with the model's identity on it and on its tables: a preset's spec, a profile's hash, a config
    read through transformers where neither says (``--analytic`` of a config.json, a profile stored before
    profiles carried the hash; loads the torch floor); a ``--profile`` file without one keeps its name alone."""
    if found.spec is not None and found.spec.name in PRESETS:
        identity = spec_id(found.spec)
    elif found.profiles and (found.profiles[0].model_hash or from_file):
        identity = ModelId(found.profiles[0].model, found.profiles[0].model_hash)
    else:
        models = importlib.import_module("recompute.models.identity")
        identity = models.source_identity(_trace().resolve_source(model))
    tables = tuple(replace(t, model=identity.name, model_hash=identity.hash) for t in found.tables)
    return replace(found, tables=tables, model=identity)


def _analytic(
    model: str | Any,
    spec: ModelSpec,
    wl: Workload,
    modes: Sequence[str],
    device: Device | None,
    measured: str | Path | None,
    offload: bool,
    progress: Progress,
    notes: list[str],
) -> ModelTables:
    wl.check(spec)
    why_not = unpriced(wl, preset=spec.name in PRESETS) if device is not None else None
    if why_not:
        notes.append(f"costs in recomputed FLOPs: no time predicted with {why_not}")
        device = None
    network = network_notes(device, wl) if device is not None else []  # a layout off the nodes: refused before tracing
    require(
        measured is None or list(modes) == [wl.loss],
        "a measured bench file prices one loss mode: plan with its loss only",
        fields=("loss",),
    )
    tables = []
    priced_offload = None
    for mode in modes:
        w = with_loss(wl, mode)
        if measured is not None:
            seconds, base = measured_costs(measured, spec.name, spec.n_layers)
            tables.append(analytic_table(spec, w, seconds=seconds, model_seconds=base, cost_kind="measured seconds"))
            continue
        if device is None:
            tables.append(analytic_table(spec, w))
            continue
        works = model_works(model, spec, w, progress=progress)
        job = Job.of(spec, w)
        seconds, base = layer_costs(works, device, job)
        off = offload_layer_seconds(works["none"], layer_activations(spec, w).offloaded("offload"), device, job)
        priced_offload = off if offload else None
        table = analytic_table(
            spec,
            w,
            seconds=seconds,
            model_seconds=base,
            offload=priced_offload,
            cost_kind=f"predicted seconds on {device.label}",
            device=device.to_dict(),
        )
        tables.append(replace(table, tokens=job.tokens))  # tokens/s of the step: m b s d
    if offload and priced_offload is None:
        cost = "measured seconds" if measured is not None else "flops" if device is None else "time"
        notes.append(f"offload not considered: {unpriced_offload(device, cost)}")
    notes += network

    def alternatives(change: Workload) -> float:
        return smallest_achievable(analytic_table(spec, change))

    return ModelTables(tuple(tables), spec, (), tuple(notes), alternatives)


def _profiled(
    model: str | Any,
    wl: Workload,
    modes: Sequence[str],
    device: Device | None,
    offload: bool,
    profile: str | Path | None,
    progress: Progress,
    notes: list[str],
) -> ModelTables:
    network = network_notes(device, wl) if device is not None else []  # a layout off the nodes: refused before tracing
    if profile is not None:
        found = Profile.load(profile)
        profiles: tuple[Profile, ...] = (found,)
        if len(modes) > 1:
            notes.append("the chunked loss not considered: --profile holds one loss mode's profile")
    else:
        profiles = _profiles_by_mode(model, wl, modes, progress, notes)
    measured = profiles
    profiles = tuple(found.restated(wl.precision, wl.dp, fsdp=wl.fsdp) for found in profiles)  # the states asked for
    tables = []
    for found_profile in profiles:
        priced = profile_offload_seconds(found_profile, device, wl) if offload and device is not None else None
        table = found_profile.cost_table(device, offload=priced)
        if device is not None:
            table = scheduled_profile_table(table, found_profile, device, wl)
        tables.append(table)
    why_not = _offload_left_out(profiles[0], device) if offload else None
    if why_not:
        notes.append(f"offload not considered: {why_not}")
    notes += network
    return ModelTables(tuple(tables), None, profiles, tuple(notes), _restated_alternatives(measured, wl))


def _profiles_by_mode(
    model: str | Any, wl: Workload, modes: Sequence[str], progress: Progress, notes: list[str]
) -> tuple[Profile, ...]:
    """The profile of each loss mode in ``modes`` (``wl``'s first), measured in one pass where every mode can be
    (``profiles_of``); else ``wl``'s alone, and each other mode the model cannot take left out with a note, not
    the whole plan.

    Note: [one pass over the loss modes] a profile's chained step, its longest (the links), is the same under
    every loss mode (``recompute.trace.profiles``): measured once for both modes of a plan, not once each, it is
    half a cold plan's time less (issue 39), and every figure is the one a pass of its own measures."""
    if len(modes) > 1:
        with contextlib.suppress(ConfigError):  # a mode the model cannot take: measured apart, below
            return profiles_of(model, wl, modes[1:], progress=progress)
    profiles = profiles_of(model, wl, modes[:1], progress=progress)
    for mode in modes[1:]:
        try:
            profiles += profiles_of(model, with_loss(wl, mode), progress=progress)
        except ConfigError as e:
            notes.append(f"the {mode} loss not considered: {first_line(e)}")
    return profiles


RESTATED = ("precision", "dp", "fsdp")
"""The workload fields a profile re-prices rather than measures (its states), autocast aside."""


def _restated_alternatives(measured: Sequence[Profile], wl: Workload) -> Callable[[Workload], float | None]:
    """The smallest achievable peak of a profiled model at another workload: known where only its states change
    (precision within one-dtype steps or within amp, data parallelism, FSDP), re-priced from the same profiles;
    None where the step itself changes (it would be measured again), as it does for any other sharding of a
    profile traced as one FSDP rank."""
    same = {k: v for k, v in wl.to_dict().items() if k not in RESTATED}

    def alternatives(change: Workload) -> float | None:
        if {k: v for k, v in change.to_dict().items() if k not in RESTATED} != same:
            return None
        if (change.precision == AMP) != (wl.precision == AMP):
            return None
        if wl.fsdp and (change.precision, change.dp, change.fsdp) != (wl.precision, wl.dp, True):
            return None  # an FSDP rank's profile is of its own sharding (Profile.restated)
        restated = (p.restated(change.precision, change.dp, fsdp=change.fsdp) for p in measured)
        return smallest_achievable(tuple(p.cost_table(None) for p in restated))

    return alternatives


def shown_offload(found: Profile, device: Device | None, wl: Workload) -> dict[int, float] | None:
    """Offload's cost per kind when a profile is shown rather than planned (``estimate``, ``profile``): its
    copies' seconds on a device with a host link, none without a device (it replays no FLOP); None where its
    time is not priced (``Profile.cost_table``'s ``offload``)."""
    if device is None:
        return dict.fromkeys(range(len(found.kinds)), 0.0)
    return profile_offload_seconds(found, device, wl)


def _offload_left_out(found: Profile, device: Device | None) -> str | None:
    """Why a profiled model's plan cannot weigh offload, or None: it is priced by copy time on a GPU's host link
    (``recompute.core.pricing.profile_offload_seconds``), and measured by profiles made since it was."""
    if device is None or device.kind == "cpu" or not host_link(device):
        return unpriced_offload(device, "flops" if device is None else "time")
    if not found.offloads():
        return "the profile predates offload's measurement; make it again with recompute profile"
    if not any("offload" in k.host for k in found.kinds):
        return "no layer of the model takes it (the profile's notes say why)"
    return None


def profiles_of(
    model: str | Any, wl: Workload, modes: Sequence[str] = (), *, progress: Progress = no_progress
) -> tuple[Profile, ...]:
    """The model's profile in ``wl``'s loss mode and each other of ``modes``: from the store without torch, or
    measured now (the torch floor loaded).

    Raises:
        ConfigError: a workload a profile cannot take (parallelism), or a model that cannot be built.
    """
    sizes, fields = parallel_sizes(wl, ("tp", "pp"))
    require(
        wl.tp == wl.pp == wl.dp == 1 or _states_only(wl),
        f"a profile measures one device's step; drop {sizes} (recompute estimate --analytic models them)",
        fields=fields,
    )
    # a data-parallel rank runs the same step, its states re-priced (Profile.restated); an FSDP rank is traced as it is
    one = wl if wl.fsdp else one_device(wl)
    wanted = [with_loss(one, mode) for mode in dict.fromkeys((wl.loss, *modes))]
    if isinstance(model, str) and is_path(model):
        identity = store.config_identity(hf_config_dict(model))
        found = [store.load("profiles", store.step_key(identity, w.to_dict()), Profile.from_dict) for w in wanted]
        if all(p is not None for p in found):
            named = config_named(model)  # the file asked for, not the one that made the stored profile
            return tuple(p.named(*named) for p in found if p is not None)
    trace = _trace()
    source = trace.resolve_source(model) if isinstance(model, str) else model
    # those not cached measured together (Note: [one pass over the loss modes])
    found_now = trace.cached_profiles(source, one, [w.loss for w in wanted], progress=progress)
    return tuple(found_now[w.loss][0] for w in wanted)


def _states_only(wl: Workload) -> bool:
    """Data parallelism changes only the model states (the distributed optimizer), not the measured step."""
    return wl.tp == wl.pp == 1


def preset_works(spec: ModelSpec, wl: Workload, *, progress: Progress = no_progress) -> dict[str, StepWork]:
    """Each uniform policy's step work of a preset, from the store without torch, or traced now (two and three
    layers, scaled). One rank's step of one micro-batch: tensor and sequence parallelism kept (rank 0 on a fake
    process group, its collectives filed), the pipeline, data parallelism and the micro-batch count dropped
    (``recompute.core.pricing`` lays the step out on them)."""
    one = replace(wl, pp=1, dp=1, sp=wl.sp and wl.tp > 1, interleave=1, n_microbatches=None)
    key = store.step_key(store.spec_identity(spec.to_dict()), one.to_dict())
    found = {name: store.load("work", f"{key}-{name}", StepWork.from_dict) for name in POLICIES}
    if all(w is not None for w in found.values()):
        return {name: w for name, w in found.items() if w is not None}
    return dict(_trace().cached_works(spec, one, list(POLICIES), progress=progress))


def model_works(
    model: str | Any, spec: ModelSpec, wl: Workload, *, progress: Progress = no_progress
) -> dict[str, StepWork]:
    """Each uniform policy's step work of one rank of a model read analytically: a preset's (``preset_works``),
    or the class a transformers config names, traced whole at one device (cached), with each MoE layer's
    all-to-alls under expert parallelism added (``recompute.core.pricing.with_expert_parallelism``).

    Raises:
        ConfigError: the model cannot be traced (tensor parallelism of transformers' class: ``unpriced``).
    """
    if spec.name in PRESETS:
        works = preset_works(spec, wl, progress=progress)
    else:
        why = unpriced(wl, preset=False)
        require(why is None, f"no time predicted with {why}; add --no-time", fields=("tp",))
        one = replace(wl, ep=1, capacity_factor=1.0, pp=1, dp=1, interleave=1, n_microbatches=None, sp=False)
        trace = _trace()
        source = trace.resolve_source(model) if isinstance(model, str) else model
        works = dict(trace.cached_works(source, one, list(POLICIES), progress=progress))
    return with_expert_parallelism(works, spec, wl)


def _trace() -> ModuleType:
    """The torch floor's trace package, loaded on first need (``import torch`` takes seconds)."""
    return importlib.import_module("recompute.trace")

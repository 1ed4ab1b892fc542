"""The Python API a notebook user reaches for: ``estimate``, ``profile`` and ``plan`` of any model, by name,
config or module, with the workload as keyword arguments.

    >>> import recompute
    >>> recompute.estimate("llama3.1-8b", 4096, "block").peak > 0
    True
    >>> plan = recompute.plan("path/to/config.json", budget="24GiB", gpu="rtx4090-24gb", seq_len=4096)  # doctest: +SKIP
    >>> recompute.apply(model, plan)  # doctest: +SKIP

A model is a preset name, a transformers config (a config.json path or its folder, a dict, a
``PretrainedConfig``), a ``package.module:factory`` string, or a built ``nn.Module`` (recompute's GPT/Llama, a
transformers model, any decoder-only LM: measured from a copy on the meta device, its weights untouched).
Workload keywords are ``Workload``'s fields (``seq_len``, ``micro_batch``, ``dtype``, ``tp``, ...). Nothing here
imports torch until a model has to be built or measured.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recompute.compile_plan import BUDGETS, with_memory_budget
from recompute.core.analytic import Estimate
from recompute.core.analytic import estimate as analytic_estimate
from recompute.core.errors import ConfigError, require
from recompute.core.plan import Plan, parse_budget, require_fits
from recompute.core.plan import plan as plan_tables
from recompute.core.policy import Policy
from recompute.core.presets import PRESETS
from recompute.core.pricing import choose_device, priced_on
from recompute.core.profile import Profile
from recompute.core.spec import ModelSpec, analytic_model
from recompute.core.workload import Workload, default_precision, one_device
from recompute.planning import cost_tables, max_positions
from recompute.progress import ProgressArg, shown_progress

__all__ = ["estimate", "plan", "profile"]

DEFAULT_SEQ_LEN = 2048
"""The sequence length when none is given (or the model's context if shorter), as on the command line."""


def estimate(
    model: ModelSpec | str,
    seq_len: int | Workload | None = None,
    policy: Policy | str = "none",
    **workload: Any,
) -> Estimate:
    """Memory by component and FLOPs of one training step of ``model`` under ``policy``, from the analytic model.

    Args:
        model: a ``ModelSpec``, a preset name (``"llama3.1-8b"``) or a transformers config.json the analytic model
            covers (``recompute.profile`` measures any other).
        seq_len: tokens per sequence (default 2048, or the model's context if shorter), or a whole ``Workload``.
        policy: a policy name (``"block"``, ``"full"``), a ``Policy`` or a plan file.
        **workload: any other ``Workload`` field: ``micro_batch=2``, ``tp=8``, ``sp=True``, ...

    Raises:
        ConfigError: an unknown model or policy, or a workload the model cannot take.
    """
    spec = model if isinstance(model, ModelSpec) else analytic_model(str(model))
    return analytic_estimate(spec, _workload(seq_len, workload, spec.max_positions), policy)


def profile(
    model: Any, seq_len: int | Workload | None = None, *, progress: ProgressArg = "auto", **workload: Any
) -> Profile:
    """What every kind of layer of ``model`` keeps, replays and costs under every policy, measured on fake tensors
    of its own class (``recompute.trace.profile``) and kept in the store: a second call returns at once.

    Args:
        model: a preset name, a transformers config (path, folder, dict or ``PretrainedConfig``), a
            ``module:factory`` string or a built ``nn.Module``.
        seq_len: tokens per sequence (default 2048, or the model's context if shorter), or a whole ``Workload``.
        progress: what a cold profile (minutes) shows: ``"auto"`` (the default) a bar when stderr is a terminal
            and nothing otherwise, True or False, or a callback ``(label, done, total)`` that receives each step.
        **workload: any other ``Workload`` field (one device: no tensor or pipeline parallelism; ``precision``
            and ``dp`` price the model states, as for a preset).
    """
    trace = importlib.import_module("recompute.trace")
    source = _source(model)
    wl = _workload(seq_len, workload, source.max_positions, traced=True)
    with shown_progress("profile", progress) as show:
        measured: Profile = trace.cached_profile(source, one_device(wl), progress=show)[0]
    return measured.restated(wl.precision, wl.dp, fsdp=wl.fsdp)  # the states in the precision asked for


def plan(
    model: Any,
    budget: str | float | None = None,
    *,
    gpu: str | None = None,
    device_profile: str | Path | None = None,
    compiled: bool = False,
    seq_len: int | Workload | None = None,
    cost: str = "time",
    consider: Sequence[str] | None = None,
    host_budget: str | float | None = None,
    trace: bool = False,
    memory_budget: str | Sequence[float] | None = None,
    per_block: bool = False,
    progress: ProgressArg = "auto",
    **workload: Any,
) -> Plan:
    """The cheapest per-layer recomputation of ``model`` whose predicted peak fits ``budget``, as
    ``recompute plan`` finds it; ``recompute.apply(model, plan)`` takes the result (or its file, ``plan.save``).

    Args:
        model: as ``profile``'s (a preset is read by the analytic model, anything else by its profile).
        budget: bytes per GPU, a size (``"70GiB"``) or a GPU name (its usable memory); default: ``gpu``'s.
        gpu: the GPU the plan is priced on (its datasheet row; default an H100 SXM); ``device_profile``: a
            ``recompute calibrate`` file instead.
        compiled: price the step as run under ``torch.compile`` or CUDA graphs (no eager host dispatch).
        seq_len: tokens per sequence, or a whole ``Workload``.
        cost: ``time`` (predicted on the device) or ``flops``.
        consider: besides recomputation, ``offload`` and ``chunked`` (the chunked loss); None (the default): both,
            ``()``: recomputation alone.
        host_budget: host memory per GPU the offloaded layers may take.
        trace: check the chosen plan's peak on the real step (fake tensors) and re-plan until it fits; on CUDA
            what must fit is what the caching allocator reserves over its steps (a GPU's budget then leaves out
            its fragmentation allowance, which that replay measures).
        memory_budget: weigh ``torch.compile``'s ``activation_memory_budget`` beside the per-layer policies
            (``recompute.compile_plan``; implies ``compiled``): ``"auto"`` or fractions in (0, 1]. The plan is
            then the cheapest of the knob, the policies and their mix, and ``apply`` sets its budget.
        per_block: with ``memory_budget``, each layer compiled on its own, the rest eager, as torchtitan compiles
            (the budget a fraction of each block's); default: the whole model compiled.
        progress: what the minutes of a cold profile (or of pricing a preset's time) show: ``"auto"`` (the
            default) the command line's bar when stderr is a terminal and nothing otherwise, True or False, or a
            callback ``(label, done, total)`` that receives each step.
        **workload: any other ``Workload`` field.

    Raises:
        ConfigError: nothing fits (the message says the smallest achievable peak and what would fit), or bad input.
    """
    require(cost in ("time", "flops"), f"cost must be time or flops, got {cost!r}", fields=("cost",))
    consider = _considered(consider)
    require(gpu is None or isinstance(gpu, str), f"gpu must be a GPU's name, got {gpu!r}", fields=("gpu",))
    for key, value in (("compiled", compiled), ("trace", trace), ("per_block", per_block)):
        require(isinstance(value, bool), f"{key} must be True or False, got {value!r}", fields=(key,))
    budgets = _memory_budgets(memory_budget)
    require(
        budgets is not None or not per_block,
        "per_block says how the compiled step weighed by memory_budget is compiled; give memory_budget",
        fields=("per_block",),
    )
    compiled = compiled or budgets is not None  # the budget is torch.compile's: no eager host dispatch
    if budget is None and gpu is None:
        raise ConfigError("plan needs a budget: give budget= (e.g. '70GiB') or gpu= (its usable memory)")
    host = parse_budget(host_budget, "host_budget") if host_budget is not None else None
    device = choose_device(gpu=gpu, device_profile=device_profile, compiled=compiled) if cost == "time" else None
    name = _name(model)
    positions = max_positions(name) if name is not None else _source(model).max_positions
    wl = _workload(seq_len, workload, positions, traced=name not in PRESETS)
    device, said = priced_on(wl, device, asked=bool(gpu or device_profile))
    limit = parse_budget(budget if budget is not None else str(gpu), replayed=trace and wl.device == "cuda")
    losses = ("chunked",) if "chunked" in consider else ()
    target: Any = name if name is not None else _source(model)
    if device is not None and name in PRESETS:  # refuse before pricing (tracing) time
        found = cost_tables(name, wl, losses=losses, offload="offload" in consider and not said)
        require_fits(found.tables, limit, host_budget=host, alternatives=found.alternatives)
    with shown_progress("plan", progress) as show:
        found = cost_tables(
            target, wl, device=device, losses=losses, offload="offload" in consider and not said, progress=show
        )
    checked = None
    if trace:
        checked = importlib.import_module("recompute.trace").step_needs(
            found.spec if found.spec is not None else target
        )
    result = plan_tables(
        found.tables,
        limit,
        host_budget=host,
        traced_peak=checked,
        alternatives=found.alternatives,
        notes=(*said, *found.notes),
    )
    if budgets is None:
        return result
    with shown_progress("plan", progress) as show:
        return with_memory_budget(
            result, target, wl, tables=found.tables, budgets=budgets, per_block=per_block, progress=show
        )[0]


def _memory_budgets(value: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """``plan``'s ``memory_budget``: None, ``"auto"`` (``BUDGETS``) or fractions in (0, 1].

    Raises:
        ConfigError: anything else.
    """
    if value is None:
        return None
    if value == "auto":
        return BUDGETS
    ok = not isinstance(value, str) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1 for v in value
    )
    require(
        ok and len(value) > 0,
        f"memory_budget is 'auto' or fractions in (0, 1] (e.g. (1.0, 0.5, 0.2)), got {value!r}",
        fields=("memory_budget",),
    )
    return tuple(float(v) for v in value)


def _considered(consider: Sequence[str] | None) -> Sequence[str]:
    """``plan``'s ``consider``, None as the default set (it was a TypeError, issue 38), checked.

    Raises:
        ConfigError: not a list of names, or a name other than offload and chunked.
    """
    consider = ("offload", "chunked") if consider is None else consider
    require(
        isinstance(consider, (list, tuple, set, frozenset)) and all(isinstance(c, str) for c in consider),
        f"consider must be a list of offload and chunked (or empty: recomputation alone), got {consider!r}",
        fields=("consider",),
    )
    unknown = set(consider) - {"offload", "chunked"}
    require(not unknown, f"consider takes offload and chunked, got {sorted(unknown)}", fields=("consider",))
    return consider


def _workload(
    seq_len: int | Workload | None, fields: dict[str, Any], positions: int | None, *, traced: bool = False
) -> Workload:
    """A ``Workload`` from a positional ``seq_len`` (or a whole one) and keyword fields; a model recompute
    traces (``traced``) gets ``default_precision``'s (amp in a 16-bit dtype) when none is given."""
    if isinstance(seq_len, Workload):
        require(not fields, f"give a Workload or its fields, not both (got {sorted(fields)})")
        return seq_len
    known = set(Workload.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    require(not unknown, f"unknown workload fields {unknown}; known: {sorted(known)}")
    if seq_len is None:
        seq_len = fields.pop("seq_len", None) or min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
    if fields.get("precision") is None:
        fields = {**fields, "precision": default_precision(preset=not traced, dtype=fields.get("dtype", "bf16"))}
    return Workload(seq_len=seq_len, **fields)


def _name(model: Any) -> str | None:
    """``model`` as the command line names it (a preset, a path, ``module:factory``), or None for an object."""
    if isinstance(model, Path):
        return str(model)
    if isinstance(model, str):
        return model
    if isinstance(model, ModelSpec):
        return model.name if model.name in PRESETS and ModelSpec.from_name(model.name) == model else None
    return None


def _source(model: Any) -> Any:
    """A ``ModelSource`` for any model ``profile`` takes (the torch floor loaded)."""
    source = importlib.import_module("recompute.models.source")
    if isinstance(model, (str, Path)):
        return source.resolve_source(str(model))
    if isinstance(model, ModelSpec):
        return source.ModelSource.preset(model)
    if isinstance(model, dict) or type(model).__name__.endswith("Config"):
        return source.ModelSource.from_config(model)
    if callable(getattr(model, "named_parameters", None)):
        return source.ModelSource.from_module(model)
    raise ConfigError(
        f"a model is a preset name, a config.json path, a transformers config, a module:factory or an nn.Module; "
        f"got {type(model).__name__}"
    )

"""A recompute plan in a Hugging Face ``Trainer`` script: applied once, alone, and recorded with the run.

Two ways, one line each::

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RecomputeCallback("plan.json")])

    prepare(model, args, "plan.json")  # before Trainer(...), or before accelerate's prepare in a loop of your own

Both apply the plan with ``recompute.apply`` when the trainer is built (before accelerate prepares the model:
apply, then compile, then FSDP), which checks that the plan is for this model (the hash of its architecture:
``recompute.core.identity``) and takes the plan's loss mode. The chunked loss keeps the model's ``forward``
signature, so the Trainer's ``remove_unused_columns`` keeps the dataset's ``input_ids`` and ``labels``.

Transformers' own activation checkpointing (``TrainingArguments(activation_checkpointing=True)``, called
``gradient_checkpointing`` before transformers 5, or ``model.gradient_checkpointing_enable()``) would replay
whole layers on top of the plan: both are refused in one line, never silently combined or switched off.

The callback also records the plan with the run: ``recompute_plan.json`` in ``output_dir`` when training
begins, a summary line in the log, and the plan (without its frontier) in every checkpoint's
``trainer_state.json`` (``stateful_callbacks``), from which a resumed run rebuilds the callback.

Note: [the plan's workload] a plan is priced for one step (``Workload``): its precision, micro-batch, sharding.
The callback reads the run's from ``TrainingArguments`` and the model (``trainer_workload``: ``bf16``/``fp16`` are
autocast over the model's fp32 weights, the ``amp`` precision; ``fsdp`` full shard is ``--fsdp`` over the world
size; ``per_device_train_batch_size`` the micro-batch; gradient accumulation keeps the gradients between
micro-batches, ``--keep-grads``) and refuses a plan made for another step in one line that names each difference
and the command that plans this one, or, with ``replan=True``, plans this step itself (``recompute.plan`` of the
model's config at the plan's budget and device).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

try:
    from transformers.trainer_callback import ExportableState
except ImportError:  # transformers before 4.42: no callback state in checkpoints
    ExportableState = object  # type: ignore[misc,assignment]

from recompute.checkpointing import HF_CHECKPOINTING, applied_policy, apply
from recompute.core.errors import ConfigError, require
from recompute.core.plan import plan as plan_tables
from recompute.core.plan_file import Plan, check_plan_dict, plan_loss
from recompute.core.policy import Policy
from recompute.core.pricing import choose_device
from recompute.core.results import read_json
from recompute.core.table import gib
from recompute.core.workload import AMP, LOSSES, build_workload, workload_fields
from recompute.models.source import ModelSource
from recompute.planning import cost_tables

__all__ = ["PLAN_FILE", "RecomputeCallback", "prepare", "summary", "trainer_workload"]

PLAN_FILE = "recompute_plan.json"
"""The plan's copy in the run's ``output_dir``."""

_RECORDED = ("format", "model", "source", "workload", "budget", "cost_kind", "device", "policy", "loss", "predicted")
"""What of a plan file the trainer state keeps (not the frontier or the uniform policies)."""

logger = logging.getLogger("recompute")


def prepare(
    model: nn.Module,
    args: TrainingArguments | None,
    plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any],
    **apply_options: Any,
) -> None:
    """Apply ``plan`` to ``model`` for a ``Trainer`` run with ``args``, refusing transformers' checkpointing.

    Args:
        args: the run's ``TrainingArguments`` (None: a loop of your own, e.g. with accelerate).
        plan: what ``recompute.apply`` takes: a plan file (``recompute plan -o``), a ``Plan``, a ``Policy``
            or a policy name.
        apply_options: ``recompute.apply``'s keywords (``loss``, ``loss_chunk``, ``layers``, ``attn``, ``mlp``).

    Raises:
        ConfigError: ``args`` or the model with transformers' checkpointing on; a plan for another model; what
            ``recompute.apply`` refuses.
    """
    if args is not None:
        _refuse_checkpointing(args)
    _check_apply_options(apply_options)
    apply(model, _as_data(plan), **apply_options)


def summary(plan: Mapping[str, Any]) -> str:
    """One line: the policy, the loss mode, the model and, for a plan, its predicted peak against its budget."""
    policy = Policy.from_dict(dict(plan))
    loss = plan_loss(plan)
    text = f"recompute: {policy.describe()}" + ("; chunked loss" if loss and loss[0] == "chunked" else "")
    if policy.model is not None:
        text += f" for {policy.model.describe()}"
    predicted, budget = plan.get("predicted"), plan.get("budget")
    if isinstance(predicted, Mapping) and isinstance(predicted.get("peak"), (int, float)) and budget:
        text += f"; predicted peak {gib(predicted['peak'])} of the {gib(float(budget))} budget"
    return text


class RecomputeCallback(TrainerCallback, ExportableState):  # type: ignore[misc]
    """Apply a recompute plan in a ``Trainer`` (see the module docstring); ``Trainer(..., callbacks=[...])``.

    Args:
        plan: a plan file (``recompute plan -o``), its content, a ``Plan``, a ``Policy`` or a policy name.
        replan: a plan made for another step than the Trainer's (its precision, micro-batch, sharding: the note
            in the module docstring) is planned again for this one at the plan's budget, instead of refused.
        apply_options: ``recompute.apply``'s keywords (``loss``, ``loss_chunk``, ``layers``, ``attn``, ``mlp``).

    Raises:
        ConfigError: an unreadable plan (at construction); at the trainer's construction, what ``prepare``
            refuses, and a plan made for another step (without ``replan``).
    """

    def __init__(
        self,
        plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any],
        *,
        replan: bool = False,
        **apply_options: Any,
    ) -> None:
        self.plan = _as_data(plan)
        require(isinstance(replan, bool), f"replan must be True or False, got {replan!r}", fields=("replan",))
        _check_apply_options(apply_options)  # at construction: the Trainer's would fail at its first step
        self.replan = replan
        self.apply_options = apply_options

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is not None:
            self._prepare(model, args)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        _refuse_checkpointing(args)
        if model is not None and applied_policy(model) is None:  # a model_init built a new model in train()
            self._prepare(model, args)
        line = summary(self.plan)
        logger.info(line)
        if state.is_world_process_zero and args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / PLAN_FILE).write_text(json.dumps(self.plan, indent=2) + "\n")

    def _prepare(self, model: nn.Module, args: TrainingArguments) -> None:
        """Check the plan against the step the Trainer runs (or plan that step), then ``prepare``."""
        run = trainer_workload(args, model)
        differ = _differences(self.plan.get("workload"), run)
        if differ and self.replan:
            self.plan = _replanned(model, self.plan, run)
        elif differ:
            raise ConfigError(_mismatch(self.plan, differ, run))
        prepare(model, args, self.plan, **self.apply_options)

    def state(self) -> dict[str, Any]:
        """What a checkpoint's ``trainer_state.json`` keeps: the plan without its frontier, and the options."""
        recorded = {k: v for k, v in self.plan.items() if k in _RECORDED}
        return {"args": {"plan": recorded, **self.apply_options}, "attributes": {}}


def trainer_workload(args: TrainingArguments, model: nn.Module) -> dict[str, tuple[Any, str]]:
    """The ``Workload`` fields a Trainer run fixes, each with the setting it comes from (the module's note).

    Raises:
        ConfigError: a sharding recompute does not model (FSDP other than full shard).
    """
    out: dict[str, tuple[Any, str]] = {
        "micro_batch": (int(args.per_device_train_batch_size), "per_device_train_batch_size"),
        "keep_grads": (int(args.gradient_accumulation_steps) > 1, "gradient_accumulation_steps"),
    }
    weights = next((p.dtype for p in model.parameters()), None)
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if half is not None and weights == _torch_dtype("float32"):
        out.update(dtype=(half, f"{half}=True"), precision=(AMP, f"{half}=True over fp32 weights"))
    elif weights == _torch_dtype("bfloat16"):
        out.update(dtype=("bf16", "the model's bf16 weights"), precision=("bf16", "the model's bf16 weights"))
    elif weights == _torch_dtype("float32"):
        out.update(dtype=("fp32", "fp32 weights, no bf16/fp16"), precision=("fp32", "fp32 weights, no bf16/fp16"))
    for name in ("max_length", "max_seq_length"):  # TRL's SFTConfig
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            out["seq_len"] = (value, name)
            break
    sharding = _fsdp_options(args)
    if sharding:
        require(
            "full_shard" in sharding,
            f"recompute models FSDP full shard; this Trainer asks {' '.join(sorted(sharding))}: shard fully "
            "(fsdp=True with reshard_after_forward, or fsdp='full_shard' before transformers 5)",
        )
        out.update(fsdp=(True, "fsdp='full_shard'"), dp=(int(args.world_size), "the world size under fsdp"))
    return out


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _fsdp_options(args: TrainingArguments) -> set[str]:
    """The run's FSDP sharding as words (``full_shard``, ``shard_grad_op``, ...): transformers 5's ``fsdp=True``
    shards fully unless ``fsdp_config`` says ``reshard_after_forward: False``; before, ``fsdp`` was a string or a
    list of them (or of ``FSDPOption``)."""
    raw = getattr(args, "fsdp", None) or []
    if raw is True:
        config = getattr(args, "fsdp_config", None) or {}
        full = not isinstance(config, Mapping) or config.get("reshard_after_forward", True) not in (False, "false")
        return {"full_shard" if full else "reshard_after_forward=False"}
    items = raw.split() if isinstance(raw, str) else [str(getattr(o, "value", o)) for o in raw]
    return {word for item in items for word in item.split()}


def _differences(planned: Any, run: Mapping[str, tuple[Any, str]]) -> list[str]:
    """Each field of the run's step that the plan's workload prices otherwise, as ``field planned -> run (why)``."""
    if not isinstance(planned, Mapping):
        return []  # a policy, not a plan: nothing was priced
    defaults = {f.name: f.default for f in workload_fields()}
    out = []
    for name, (value, why) in run.items():
        was = planned.get(name, defaults.get(name))
        if was != value:
            out.append(f"{name} {was} in the plan, {value} in this run ({why})")
    return out


def _mismatch(plan: Mapping[str, Any], differ: list[str], run: Mapping[str, tuple[Any, str]]) -> str:
    flags = " ".join(_flag(name, value) for name, (value, _) in run.items())
    return (
        f"this plan was made for another step than this Trainer runs: {'; '.join(differ)}; plan this one "
        f"(recompute plan --model <config> {flags} ...) or pass RecomputeCallback(plan, replan=True)"
    )


def _flag(name: str, value: Any) -> str:
    flag = next(f.metadata["flag"] for f in workload_fields() if f.name == name)
    if isinstance(value, bool):
        return flag if value else ""
    return f"{flag} {value}"


def _replanned(model: nn.Module, plan: Mapping[str, Any], run: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """The plan of the run's step: the model's config planned at the plan's budget, on its device's datasheet
    row (FLOPs where the plan was priced otherwise), the chunked loss weighed, as ``recompute.plan`` does.

    Raises:
        ConfigError: nothing fits the budget at the run's step (the message says what would).
    """
    wl = build_workload(**{**dict(plan.get("workload") or {}), **{k: v for k, (v, _) in run.items()}})
    device = plan.get("device") or {}
    gpu = device.get("name") if isinstance(device, Mapping) and device.get("measured") == {} else None
    priced = choose_device(gpu=gpu) if gpu else None
    source = ModelSource.from_config(model.config) if hasattr(model, "config") else ModelSource.from_module(model)
    found = cost_tables(source, wl, device=priced, losses=("chunked",))
    result = plan_tables(found.tables, float(plan["budget"]), alternatives=found.alternatives, notes=found.notes)
    logger.warning("recompute: planned this Trainer's step again (%s)", result.policy.describe())
    return result.to_dict()


_APPLY_OPTIONS = ("layers", "attn", "mlp", "loss", "loss_chunk")
"""``recompute.apply``'s keywords, which ``prepare`` and ``RecomputeCallback`` pass on."""


def _check_apply_options(options: Mapping[str, Any]) -> None:
    """Refuse an option ``recompute.apply`` does not take, or one of the wrong type, before the Trainer runs.

    Raises:
        ConfigError: the first such option, with what it takes.
    """
    unknown = sorted(set(options) - set(_APPLY_OPTIONS))
    require(not unknown, f"unknown options {unknown}; recompute.apply takes {', '.join(_APPLY_OPTIONS)}")
    for key in ("layers", "attn", "mlp"):
        value = options.get(key)
        require(value is None or isinstance(value, str), f"{key} must be a name (a str), got {value!r}", fields=(key,))
    loss, chunk = options.get("loss"), options.get("loss_chunk")
    require(loss in (None, *LOSSES), f"loss must be one of {', '.join(LOSSES)}, got {loss!r}", fields=("loss",))
    whole = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
    require(chunk is None or whole, f"loss_chunk must be a positive integer, got {chunk!r}", fields=("loss_chunk",))


def _as_data(plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any]) -> dict[str, Any]:
    """The plan as a plan file's JSON (a policy's alone for a ``Policy`` or a name); checked readable now."""
    if isinstance(plan, (Plan, Policy)):
        data = plan.to_dict()
    elif isinstance(plan, Mapping):
        data = dict(plan)
    elif isinstance(plan, (str, os.PathLike)) and (os.fspath(plan).endswith(".json") or Path(plan).is_file()):
        data = read_json(os.fspath(plan), "plan file", "pass a file written by `recompute plan -o plan.json`")
    elif isinstance(plan, str):
        data = Policy.parse(plan).to_dict()
    else:
        raise ConfigError(f"expected a plan file, a Plan, a Policy or a policy name; got {type(plan).__name__}")
    check_plan_dict(data)
    try:
        Policy.from_dict(data)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"not a recompute plan or policy ({e}); pass a file written by `recompute plan -o`") from e
    return data


def _checkpointing_asked(args: TrainingArguments) -> bool:
    """``activation_checkpointing`` (transformers 5) or its older name ``gradient_checkpointing``."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


def _refuse_checkpointing(args: TrainingArguments) -> None:
    """Transformers' checkpointing, or FSDP's own (``fsdp_config={"activation_checkpointing": True}``), would
    replay whole layers on top of the plan: refused in one line."""
    if _checkpointing_asked(args):
        raise ConfigError(HF_CHECKPOINTING)
    config = getattr(args, "fsdp_config", None) or {}
    if isinstance(config, Mapping) and config.get("activation_checkpointing"):
        raise ConfigError(
            'fsdp_config={"activation_checkpointing": True} checkpoints every layer on top of the recompute plan; '
            "drop it: the plan decides what each layer recomputes"
        )

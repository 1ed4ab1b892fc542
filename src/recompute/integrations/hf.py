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
from recompute.core.errors import ConfigError
from recompute.core.plan_file import Plan, check_plan_dict, plan_loss
from recompute.core.policy import Policy
from recompute.core.results import read_json
from recompute.core.table import gib

__all__ = ["PLAN_FILE", "RecomputeCallback", "prepare", "summary"]

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
    if args is not None and _checkpointing_asked(args):
        raise ConfigError(HF_CHECKPOINTING)
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
        apply_options: ``recompute.apply``'s keywords (``loss``, ``loss_chunk``, ``layers``, ``attn``, ``mlp``).

    Raises:
        ConfigError: an unreadable plan (at construction); at the trainer's construction, what ``prepare``
            refuses.
    """

    def __init__(self, plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any], **apply_options: Any) -> None:
        self.plan = _as_data(plan)
        self.apply_options = apply_options

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is not None:
            prepare(model, args, self.plan, **self.apply_options)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if _checkpointing_asked(args):
            raise ConfigError(HF_CHECKPOINTING)
        if model is not None and applied_policy(model) is None:  # a model_init built a new model in train()
            prepare(model, args, self.plan, **self.apply_options)
        line = summary(self.plan)
        logger.info(line)
        if state.is_world_process_zero and args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / PLAN_FILE).write_text(json.dumps(self.plan, indent=2) + "\n")

    def state(self) -> dict[str, Any]:
        """What a checkpoint's ``trainer_state.json`` keeps: the plan without its frontier, and the options."""
        recorded = {k: v for k, v in self.plan.items() if k in _RECORDED}
        return {"args": {"plan": recorded, **self.apply_options}, "attributes": {}}


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

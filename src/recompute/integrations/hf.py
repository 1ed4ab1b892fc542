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
begins, a summary line on stderr then (where the Trainer logs, unless its ``log_level`` is above warning; also
to the ``recompute`` logger at INFO), and the plan (without its frontier) in every checkpoint's
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
import sys
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
from recompute.core.plan_file import Plan
from recompute.core.policy import Policy
from recompute.core.pricing import choose_device
from recompute.core.workload import AMP, build_workload
from recompute.integrations._plan import check_apply_options, differences, mismatch, plan_data, summary
from recompute.models.source import ModelSource
from recompute.planning import cost_tables

__all__ = [
    "PLAN_FILE",
    "RecomputeCallback",
    "accelerator_workload",
    "fsdp_plugin_workload",
    "prepare",
    "summary",
    "trainer_workload",
]

PLAN_FILE = "recompute_plan.json"
"""The plan's copy in the run's ``output_dir``."""

_RECORDED = ("format", "model", "source", "workload", "budget", "cost_kind", "device", "policy", "loss", "predicted")
"""What of a plan file the trainer state keeps (not the frontier or the uniform policies)."""

logger = logging.getLogger("recompute")


def prepare(
    model: nn.Module,
    args: TrainingArguments | None,
    plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any],
    *,
    accelerator: Any = None,
    **apply_options: Any,
) -> None:
    """Apply ``plan`` to ``model`` for a ``Trainer`` run with ``args``, refusing transformers' checkpointing.

    Args:
        args: the run's ``TrainingArguments`` (None: a loop of your own, e.g. with accelerate).
        plan: what ``recompute.apply`` takes: a plan file (``recompute plan -o``), a ``Plan``, a ``Policy``
            or a policy name.
        accelerator: a loop's ``accelerate.Accelerator``: the plan is checked against the step it runs
            (``accelerator_workload``).
        apply_options: ``recompute.apply``'s keywords (``loss``, ``loss_chunk``, ``layers``, ``attn``, ``mlp``).

    Raises:
        ConfigError: ``args`` or the model with transformers' checkpointing on; a plan for another model, or
            for another step than the accelerator's; what ``recompute.apply`` refuses.
    """
    if args is not None:
        _refuse_checkpointing(args)
    check_apply_options(apply_options)
    data = plan_data(plan)
    if accelerator is not None:
        require(
            all(hasattr(accelerator, a) for a in ("mixed_precision", "gradient_accumulation_steps", "state")),
            f"accelerator= takes the loop's accelerate.Accelerator, got a {type(accelerator).__name__}",
        )
        run = accelerator_workload(accelerator, model)
        differ = differences(data.get("workload"), run)
        if differ:
            raise ConfigError(mismatch(differ, run, "make the plan with those flags"))
    apply(model, data, **apply_options)


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
        self.plan = plan_data(plan)
        require(isinstance(replan, bool), f"replan must be True or False, got {replan!r}", fields=("replan",))
        check_apply_options(apply_options)  # at construction: the Trainer's would fail at its first step
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
        if args.should_log and args.get_process_log_level() <= logging.WARNING:
            # Note: [seen by default] transformers logs at WARNING unless told otherwise, so an INFO line was never
            # seen; once per train(), on the processes that log, unless log_level is above warning (issue 36).
            print(line, file=sys.stderr)
        if state.is_world_process_zero and args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / PLAN_FILE).write_text(json.dumps(self.plan, indent=2) + "\n")

    def _prepare(self, model: nn.Module, args: TrainingArguments) -> None:
        """Check the plan against the step the Trainer runs (or plan that step), then ``prepare``."""
        run = trainer_workload(args, model)
        differ = differences(self.plan.get("workload"), run)
        if differ and self.replan:
            self.plan = _replanned(model, self.plan, run)
        elif differ:
            raise ConfigError(mismatch(differ, run, "RecomputeCallback(plan, replan=True)"))
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
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    out.update(_precision(model, half, f"{half}=True"))
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


def accelerator_workload(accelerator: Any, model: nn.Module) -> dict[str, tuple[Any, str]]:
    """The ``Workload`` fields an ``accelerate.Accelerator`` loop fixes (its mixed precision over the model's
    weights, gradient accumulation, FSDP full shard over its processes), each with the setting it comes from.

    Raises:
        ConfigError: a sharding recompute does not model; FSDP's own activation checkpointing.
    """
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    half = mixed if mixed in ("bf16", "fp16") else None
    out: dict[str, tuple[Any, str]] = {
        "keep_grads": (int(accelerator.gradient_accumulation_steps) > 1, "gradient_accumulation_steps"),
        **_precision(model, half, f"mixed_precision={mixed!r}"),
    }
    if str(getattr(accelerator, "distributed_type", "")).endswith("FSDP"):
        out.update(fsdp_plugin_workload(accelerator.state.fsdp_plugin, int(accelerator.num_processes)))
    return out


def fsdp_plugin_workload(plugin: Any, world_size: int) -> dict[str, tuple[Any, str]]:
    """The sharding fields of accelerate's ``FullyShardedDataParallelPlugin`` over ``world_size`` processes.

    Raises:
        ConfigError: a sharding other than full shard; the plugin's own ``activation_checkpointing``.
    """
    require(
        not getattr(plugin, "activation_checkpointing", False),
        "FullyShardedDataParallelPlugin(activation_checkpointing=True) checkpoints every layer on top of the "
        "recompute plan; drop it: the plan decides what each layer recomputes",
    )
    if int(getattr(plugin, "fsdp_version", 1) or 1) >= 2:
        full, setting = getattr(plugin, "reshard_after_forward", True) is not False, "reshard_after_forward"
    else:
        name = str(getattr(getattr(plugin, "sharding_strategy", None), "name", "FULL_SHARD"))
        full, setting = name == "FULL_SHARD", f"sharding_strategy {name}"
    require(full, f"recompute models FSDP full shard; this plugin sets {setting}=False: shard fully")
    if world_size < 2:
        return {}
    return {"fsdp": (True, "accelerate's FSDP, full shard"), "dp": (world_size, "the processes under FSDP")}


def _precision(model: nn.Module, half: str | None, setting: str) -> dict[str, tuple[Any, str]]:
    """``dtype`` and ``precision`` of a step: ``half`` (bf16/fp16 autocast, from ``setting``) over fp32 weights
    is amp; bf16 weights the bf16 step; fp32 weights alone fp32."""
    weights = next((p.dtype for p in model.parameters()), None)
    if half is not None and weights == _torch_dtype("float32"):
        return {"dtype": (half, setting), "precision": (AMP, f"{setting} over fp32 weights")}
    if weights == _torch_dtype("bfloat16"):
        return {"dtype": ("bf16", "the model's bf16 weights"), "precision": ("bf16", "the model's bf16 weights")}
    if weights == _torch_dtype("float32"):
        return {"dtype": ("fp32", "fp32 weights, no bf16/fp16"), "precision": ("fp32", "fp32 weights, no bf16/fp16")}
    return {}


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

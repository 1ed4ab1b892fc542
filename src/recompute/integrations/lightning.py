"""A recompute plan in a Lightning ``Trainer``: ``Trainer(..., callbacks=[RecomputeLightning("plan.json")])``.

The callback applies the plan in ``setup``, before the strategy wraps or shards the module (apply, then FSDP:
torchtitan's order), to the model inside the ``LightningModule`` (a transformers model it holds, else the module
itself), which ``recompute.apply`` checks against the plan (the hash of its architecture). It reads the step the
Trainer runs (``lightning_workload``, Note: [the plan's workload] in ``recompute.integrations._plan``):

- ``precision``: ``bf16-mixed``/``16-mixed`` are autocast over fp32 weights (``--precision amp --dtype bf16``/
  ``fp16``), ``bf16-true`` the bf16 step (``--precision bf16``), ``32-true`` fp32;
- ``FSDPStrategy`` with ``FULL_SHARD`` (its default) is ``--fsdp --dp <world size>`` (FSDP1's flat parameters,
  priced as FSDP2's full shard); other sharding strategies are refused, as is the strategy's own
  ``activation_checkpointing_policy`` (it would replay whole layers on top of the plan);
- ``accumulate_grad_batches`` > 1 keeps the gradients between micro-batches (``--keep-grads``);
- the micro-batch and sequence length from the first training batch's ``input_ids`` (or its first tensor),
  checked before that batch's forward.

A plan made for another step is refused in one line naming each difference and the flags that plan this one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package
    from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[no-redef,assignment]

from recompute.checkpointing import apply
from recompute.core.errors import ConfigError, require
from recompute.core.plan_file import Plan
from recompute.core.policy import Policy
from recompute.core.workload import AMP
from recompute.integrations._plan import Run, check_apply_options, differences, mismatch, plan_data, summary

__all__ = ["RecomputeLightning", "batch_shape", "lightning_workload", "strategy_workload"]

logger = logging.getLogger("recompute")

PRECISIONS: dict[str, tuple[str, str]] = {
    "bf16-mixed": ("bf16", AMP),
    "16-mixed": ("fp16", AMP),
    "bf16-true": ("bf16", "bf16"),
    "32-true": ("fp32", "fp32"),
}
"""Lightning's ``precision`` -> (``--dtype``, ``--precision``)."""

INSTEAD = "make the plan with those flags"


class RecomputeLightning(Callback):  # type: ignore[misc]
    """Apply a recompute plan in a Lightning ``Trainer`` (see the module docstring).

    Args:
        plan: a plan file (``recompute plan -o``), its content, a ``Plan``, a ``Policy`` or a policy name.
        apply_options: ``recompute.apply``'s keywords (``loss``, ``loss_chunk``, ``layers``, ``attn``, ``mlp``).

    Raises:
        ConfigError: an unreadable plan (at construction); in ``setup``, a plan for another model or step, a
            precision or sharding recompute does not model, the strategy's own activation checkpointing; before
            the first training batch's forward, a plan for another micro-batch or sequence length.
    """

    def __init__(self, plan: str | os.PathLike[str] | Plan | Policy | Mapping[str, Any], **apply_options: Any) -> None:
        self.plan = plan_data(plan)
        check_apply_options(apply_options)
        self.apply_options = apply_options
        self._batch_checked = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run = lightning_workload(trainer)
        differ = differences(self.plan.get("workload"), run)
        if differ:
            raise ConfigError(mismatch(differ, run, INSTEAD))
        apply(target_model(pl_module), self.plan, **self.apply_options)
        if trainer.is_global_zero:
            logger.warning(summary(self.plan))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._batch_checked:
            return
        self._batch_checked = True
        shape = batch_shape(batch)
        if shape is None:
            return
        run = {"micro_batch": (shape[0], "the first batch's size"), "seq_len": (shape[1], "the first batch's length")}
        differ = differences(self.plan.get("workload"), run)
        if differ:
            raise ConfigError(mismatch(differ, {**lightning_workload(trainer), **run}, INSTEAD))


def lightning_workload(trainer: Trainer) -> Run:
    """The ``Workload`` fields a Lightning ``Trainer`` fixes, each with the setting it comes from.

    Raises:
        ConfigError: a precision or sharding recompute does not model; the strategy's activation checkpointing.
    """
    precision = str(trainer.precision)
    require(
        precision in PRECISIONS,
        f"recompute models Lightning's precision {', '.join(PRECISIONS)}; this Trainer runs {precision!r}",
    )
    dtype, mode = PRECISIONS[precision]
    out: dict[str, tuple[Any, str]] = {
        "dtype": (dtype, f"precision={precision!r}"),
        "precision": (mode, f"precision={precision!r}"),
        "keep_grads": (int(trainer.accumulate_grad_batches) > 1, "accumulate_grad_batches"),
    }
    out.update(strategy_workload(trainer.strategy, int(trainer.world_size)))
    return out


def strategy_workload(strategy: Any, world_size: int) -> Run:
    """The sharding fields of a Lightning strategy over ``world_size`` ranks: ``FSDPStrategy``'s full shard.

    Raises:
        ConfigError: another sharding strategy; the strategy's own activation checkpointing.
    """
    if type(strategy).__name__ != "FSDPStrategy":
        return {}
    checkpointing = getattr(strategy, "_activation_checkpointing_kwargs", None)  # no public reader
    require(
        not checkpointing,
        "FSDPStrategy(activation_checkpointing_policy=...) checkpoints whole layers on top of the recompute "
        "plan; drop it: the plan decides what each layer recomputes",
    )
    sharding = str(getattr(getattr(strategy, "sharding_strategy", None), "name", "FULL_SHARD"))
    require(
        sharding == "FULL_SHARD",
        f"recompute models FSDP full shard; this FSDPStrategy shards {sharding}: use sharding_strategy='FULL_SHARD'",
    )
    if world_size < 2:
        return {}
    return {"fsdp": (True, "FSDPStrategy (FULL_SHARD)"), "dp": (world_size, "the world size under FSDP")}


def target_model(pl_module: nn.Module) -> nn.Module:
    """The model the plan was made for: the outermost transformers model the module holds, else the module."""
    for module in pl_module.modules():
        if module is not pl_module and hasattr(module, "config") and hasattr(module.config, "model_type"):
            return module
    return pl_module


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """(micro-batch, sequence length) of a batch's token ids: ``input_ids`` of a mapping, else its first 2-d
    integer tensor; None when there is none."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        batch = batch["input_ids"]
    if isinstance(batch, torch.Tensor):
        candidates = [batch]
    elif isinstance(batch, Mapping):
        candidates = list(batch.values())
    else:
        candidates = list(batch) if isinstance(batch, (list, tuple)) else []
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return int(t.shape[0]), int(t.shape[1])
    return None

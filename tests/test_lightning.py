"""A plan in a real Lightning ``Trainer`` (``recompute.integrations.lightning``) on this CPU: applied in
``setup`` to the transformers model the module holds, its losses those of the plain run, and a plan made for
another step (precision, micro-batch, sharding, the strategy's own checkpointing) refused in one line before any
step. The plan and the tiny Qwen2 are test_integrations' (``recompute plan --analytic -o plan.json``)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from recompute import ConfigError
from recompute.checkpointing import applied_policy
from recompute.core.policy import Policy
from test_integrations import REGIONS, B, S, build, counting, make_plan

lightning = pytest.importorskip("lightning.pytorch")

from recompute.integrations.lightning import (  # noqa: E402
    RecomputeLightning,
    batch_shape,
    lightning_workload,
    strategy_workload,
)

STEPS = 3


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """The Trainer tests' plan of their tiny Qwen2 (fp32, micro-batch B, sequence S, chunked loss)."""
    return make_plan(tmp_path_factory)


class Module(lightning.LightningModule):  # type: ignore[misc]
    """The usual wrapper: a transformers causal LM, its loss from ``labels``, SGD."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(b: int = B, s: int = S) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(128, (b, s), generator=g) for _ in range(STEPS)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def fit(module: Module, callbacks: list[Any], data: list[dict[str, torch.Tensor]] | None = None, **kw: Any) -> None:
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(data or batches(), batch_size=None)
    trainer.fit(module, loader)


def test_the_trainer_runs_the_plan_with_the_plain_runs_losses(
    planned: tuple[Path, Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder, plan_path, plan = planned
    model = build(folder)
    ref, run = Module(copy.deepcopy(model)), Module(model)  # the same weights (a first build draws others)
    fit(ref, [])
    calls = counting(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="recompute"):
        fit(run, [RecomputeLightning(plan_path)])
    assert applied_policy(run.model) == Policy.from_dict(plan)
    assert calls[0] == STEPS * sum(REGIONS[p] for p in plan["policy"]["layers"]) > 0
    torch.testing.assert_close(run.losses, ref.losses, rtol=1e-5, atol=0)  # the chunked loss: rounding only
    assert any(r.getMessage().startswith("recompute: ") for r in caplog.records)


@pytest.mark.parametrize(
    ("trainer", "data", "named"),
    [
        ({"precision": "bf16-mixed"}, None, "precision fp32 in the plan, amp in this run (precision='bf16-mixed')"),
        ({"accumulate_grad_batches": 2}, None, "keep_grads False in the plan, True in this run"),
        ({}, batches(b=2 * B), f"micro_batch {B} in the plan, {2 * B} in this run (the first batch's size)"),
    ],
    ids=["bf16-mixed", "accumulation", "batch"],
)
def test_a_plan_for_another_step_is_refused(
    planned: tuple[Path, Path, dict[str, Any]], trainer: dict[str, Any], data: Any, named: str
) -> None:
    folder, plan_path, _ = planned
    module = Module(build(folder))
    with pytest.raises(ConfigError) as refused:
        fit(module, [RecomputeLightning(plan_path)], data, **trainer)
    message = str(refused.value)
    assert "\n" not in message and named in message and "recompute plan --model <config>" in message
    assert module.losses == []  # refused before any step


def test_fsdp_strategy_is_read_and_its_own_checkpointing_refused() -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    # Lightning runs FSDP on GPUs only: the strategy objects are read as a Trainer over 8 of them would
    run = strategy_workload(FSDPStrategy(), 8)
    assert run == {"fsdp": (True, "FSDPStrategy (FULL_SHARD)"), "dp": (8, "the world size under FSDP")}
    assert strategy_workload(FSDPStrategy(), 1) == {} and strategy_workload("ddp", 8) == {}
    with pytest.raises(ConfigError, match=r"^FSDPStrategy\(activation_checkpointing_policy=...\) checkpoints"):
        strategy_workload(FSDPStrategy(activation_checkpointing_policy={Qwen2DecoderLayer}), 8)
    with pytest.raises(ConfigError, match="recompute models FSDP full shard; this FSDPStrategy shards SHARD_GRAD_OP"):
        strategy_workload(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), 8)
    with pytest.raises(ConfigError, match="recompute models Lightning's precision"):
        lightning_workload(lightning.Trainer(accelerator="cpu", devices=1, precision="16-true"))


def test_batch_shape_reads_the_token_ids() -> None:
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_shape({"input_ids": ids, "labels": ids}) == (3, 7)
    assert batch_shape((torch.zeros(3, 7), ids)) == (3, 7)
    assert batch_shape(ids) == (3, 7) and batch_shape("text") is None

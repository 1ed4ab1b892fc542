"""A plan in the training stacks people use, each with the real library on this CPU: the Hugging Face Trainer
(``recompute.integrations.hf``) and accelerate, a plain loop under FSDP2 and ``torch.compile`` in the documented
order (``tests/dist/loop_worker.py`` under torchrun, gloo).

The plan comes from ``recompute plan --model <folder> --analytic -o plan.json`` (the planner's own file, its
identity the config's hash); a tiny Qwen2 is built from its config class with random weights; nothing is
downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import recompute.checkpointing
from recompute import ConfigError
from recompute.checkpointing import applied_policy
from recompute.cli import main
from recompute.core.policy import Policy

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("accelerate")

from recompute.integrations.hf import PLAN_FILE, RecomputeCallback, prepare  # noqa: E402

CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
B, S, STEPS = 4, 32, 3
REGIONS = {"none": 0, "core_attn": 1, "attn": 1, "mlp": 1, "attn+mlp": 2, "block": 1}
"""Checkpointed regions per layer under each policy: calls of ``torch.utils.checkpoint`` per forward."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    return make_plan(tmp_path_factory)


def make_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """The config's folder, and a plan of it: the frontier's point with the most kinds of policy, chunked loss."""
    folder = tmp_path_factory.mktemp("qwen") / "tiny-qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    args = ["plan", "--model", str(folder), "--analytic", "--seq-len", str(S), "--micro-batch", str(B)]
    args += ["--dtype", "fp32", "--device", "cpu", "--cost", "flops", "--consider", "chunked"]
    out = folder.parent / "plan.json"
    assert main([*args, "--budget", "1GiB", "-o", str(out)]) == 0
    frontier = json.loads(out.read_text())["frontier"]
    mixed = max((p for p in frontier if p["loss"] == "chunked"), key=lambda p: len(set(p["layers"])))
    assert main([*args, "--budget", str(mixed["peak"]), "-o", str(out)]) == 0  # the cheapest plan that fits it
    data = json.loads(out.read_text())
    assert data["policy"]["layers"] == mixed["layers"] and data["loss"]["mode"] == "chunked"
    return folder, out, data


def hf_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' own checkpointing on or off (``activation_*`` in transformers 5, ``gradient_*`` before)."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{name}_checkpointing_{'enable' if on else 'disable'}")()


def build(folder: Path) -> nn.Module:
    """The model the config names, random weights (the same ones every time)."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))


def dataset() -> Any:
    """Token ids, labels, and a column no model takes (``remove_unused_columns`` must drop it, and only it)."""
    ids = torch.randint(128, (B * STEPS, S), generator=torch.Generator().manual_seed(0)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "text": ["unused"] * len(ids)})


def training_args(out: Path, **changes: Any) -> Any:
    options = {
        "output_dir": str(out),
        "max_steps": STEPS,
        "per_device_train_batch_size": B,
        "learning_rate": 1e-3,
        "use_cpu": True,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": STEPS,
        "seed": 0,
        "data_seed": 0,
    }
    return transformers.TrainingArguments(**(options | changes))


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of ``torch.utils.checkpoint.checkpoint`` that ``apply``'s wrappers make."""
    calls = [0]
    real: Callable[..., Any] = recompute.checkpointing.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(recompute.checkpointing, "checkpoint", counted)
    return calls


def test_the_trainer_runs_the_plan_alone_and_records_it(
    planned: tuple[Path, Path, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder, plan_path, plan = planned
    ref = transformers.Trainer(model=build(folder), args=training_args(tmp_path / "ref"), train_dataset=dataset())
    ref.train()
    calls = counting(monkeypatch)
    model = build(folder)
    callback = RecomputeCallback(plan_path)
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path / "run"), train_dataset=dataset(), callbacks=[callback]
    )
    assert applied_policy(model) == Policy.from_dict(plan)  # applied when the trainer is built
    with caplog.at_level(logging.INFO, logger="recompute"):
        trainer.train()
    # the losses of a run without recomputation (the chunked loss sums in another order: rounding only)
    torch.testing.assert_close(losses(trainer), losses(ref), rtol=1e-5, atol=0)
    # the plan's policy, region by region: one checkpoint call per recomputed region per forward
    assert calls[0] == STEPS * sum(REGIONS[p] for p in plan["policy"]["layers"]) > 0
    # remove_unused_columns keeps what the forward takes (its signature survived the chunked loss)
    assert {"input_ids", "labels", "attention_mask"} <= set(trainer._signature_columns)
    assert "text" not in trainer._signature_columns
    # recorded with the run: the plan file, a summary line, the checkpoint's trainer state
    assert json.loads((tmp_path / "run" / PLAN_FILE).read_text()) == plan
    line = f"recompute: {Policy.from_dict(plan).describe()}; chunked loss for 'tiny-qwen' ({plan['model']['hash'][:8]})"
    assert any(r.getMessage().startswith(line) for r in caplog.records), [r.getMessage() for r in caplog.records]
    state = json.loads((tmp_path / "run" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    kept = state["stateful_callbacks"]["RecomputeCallback"]["args"]["plan"]
    assert kept["policy"] == plan["policy"] and kept["model"] == plan["model"] and "frontier" not in kept


@pytest.mark.parametrize("switch", ["gradient_checkpointing", "activation_checkpointing"])
def test_transformers_checkpointing_with_a_plan_is_refused(
    planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path, switch: str
) -> None:
    folder, plan_path, _ = planned
    model = build(folder)
    args = training_args(tmp_path, **{switch: True})
    with pytest.raises(ConfigError, match=r"^transformers' activation \(gradient\) checkpointing is on together"):
        transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[RecomputeCallback(plan_path)])
    assert applied_policy(model) is None  # nothing changed
    with pytest.raises(ConfigError, match="checkpointing is on together"):
        prepare(model, args, plan_path)
    # switched on on the model after the plan: refused at the first training forward, before any step
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path), train_dataset=dataset(), callbacks=[RecomputeCallback(plan_path)]
    )
    hf_checkpointing(model, True)
    with pytest.raises(ConfigError, match="would replay whole layers on top of it"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_plan_for_another_model_is_refused_by_the_trainer(
    planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, plan_path, plan = planned
    other = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**{**CONFIG, "hidden_size": 32}))
    with pytest.raises(ConfigError, match=rf"^the plan was made for 'tiny-qwen' \({plan['model']['hash'][:8]}\) but"):
        transformers.Trainer(
            model=other, args=training_args(tmp_path), train_dataset=dataset(), callbacks=[RecomputeCallback(plan_path)]
        )
    assert applied_policy(other) is None


def test_an_accelerate_loop_takes_the_plan_before_prepare(planned: tuple[Path, Path, dict[str, Any]]) -> None:
    """``prepare(model, None, plan)``, then accelerate's ``prepare``: loss and gradients of the plain loop."""
    from accelerate import Accelerator

    folder, plan_path, _ = planned
    ids = torch.randint(128, (B, S), generator=torch.Generator().manual_seed(1))
    results = []
    for with_plan in (False, True):
        model = build(folder).train()
        accelerator = Accelerator(cpu=True)
        if with_plan:
            prepare(model, None, plan_path, accelerator=accelerator)  # checked against the loop's step
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
    assert applied_policy(accelerator.unwrap_model(model)) is not None
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"mixed_precision": "bf16"}, "precision fp32 in the plan, amp in this run (mixed_precision='bf16' over fp32"),
        ({"gradient_accumulation_steps": 2}, "keep_grads False in the plan, True in this run"),
    ],
    ids=["bf16", "accumulation"],
)
def test_an_accelerate_loop_for_another_step_is_refused(
    planned: tuple[Path, Path, dict[str, Any]], settings: dict[str, Any], named: str
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    folder, plan_path, _ = planned
    AcceleratorState._reset_state(True)  # accelerate's own tests' reset: one process, several Accelerators
    try:
        model = build(folder)
        with pytest.raises(ConfigError) as refused:
            prepare(model, None, plan_path, accelerator=Accelerator(cpu=True, **settings))
    finally:
        AcceleratorState._reset_state(True)
    message = str(refused.value)
    assert "\n" not in message and named in message and "--precision" in message
    assert applied_policy(model) is None


def test_prepare_refuses_what_is_not_an_accelerator(planned: tuple[Path, Path, dict[str, Any]]) -> None:
    folder, plan_path, _ = planned
    model = build(folder)
    with pytest.raises(ConfigError, match=r"^accelerator= takes the loop's accelerate\.Accelerator, got a str$"):
        prepare(model, None, plan_path, accelerator="cpu")
    assert applied_policy(model) is None


def test_accelerates_fsdp_plugin_is_read_and_its_own_checkpointing_refused() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin as Plugin

    from recompute.integrations.hf import fsdp_plugin_workload

    assert fsdp_plugin_workload(Plugin(fsdp_version=2), 8) == {
        "fsdp": (True, "accelerate's FSDP, full shard"),
        "dp": (8, "the processes under FSDP"),
    }
    with pytest.raises(ConfigError, match=r"^FullyShardedDataParallelPlugin\(activation_checkpointing=True\)"):
        fsdp_plugin_workload(Plugin(fsdp_version=2, activation_checkpointing=True), 8)
    with pytest.raises(ConfigError, match="recompute models FSDP full shard; this plugin sets reshard_after_forward"):
        fsdp_plugin_workload(Plugin(fsdp_version=2, reshard_after_forward=False), 8)


# --- a plain loop: apply, then torch.compile, then FSDP2 -------------------------------------------------------

WORKER = Path(__file__).parent / "dist" / "loop_worker.py"


def run_worker(tmp: Path, *extra: str) -> list[dict[str, Any]]:
    out = tmp / "loop.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    proc = subprocess.run(
        [*cmd, "--out", str(out), *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())["checks"]


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@needs_gloo
def test_apply_then_fsdp2_matches_one_process(tmp_path: Path) -> None:
    """recompute's Llama (full loss) and transformers' Qwen2 (chunked loss), a per-layer plan, 2 ranks."""
    checks = run_worker(tmp_path)
    assert len(checks) == 4 and [c["detail"] for c in checks if not c["ok"]] == []


@needs_gloo
@pytest.mark.slow
def test_apply_then_compile_then_fsdp2_matches_one_process(tmp_path: Path) -> None:
    """Each layer compiled (aot_eager) between ``apply`` and ``fully_shard``, as torchtitan orders them."""
    checks = run_worker(tmp_path, "--compile")
    assert len(checks) == 4 and [c["detail"] for c in checks if not c["ok"]] == []


def test_evaluation_and_prediction_get_the_logits_under_a_chunked_plan(
    planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A chunked-loss plan's training forward returns no logits; ``evaluate`` and ``predict`` (eval mode, no
    autograd) get them, so ``compute_metrics`` works (it died with a TypeError on ``logits=None``, issue 36), with
    the loss and logits of a run without the plan."""
    folder, plan_path, plan = planned
    assert plan["loss"]["mode"] == "chunked"

    def accuracy(pred: Any) -> dict[str, float]:
        logits, labels = pred.predictions, pred.label_ids
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    runs = {}
    for name, callbacks in (("ref", []), ("plan", [RecomputeCallback(plan_path)])):
        args = training_args(tmp_path / name, per_device_eval_batch_size=B)
        trainer = transformers.Trainer(
            model=build(folder), args=args, eval_dataset=dataset(), compute_metrics=accuracy, callbacks=callbacks
        )
        metrics = trainer.evaluate()
        predicted = trainer.predict(dataset())
        assert predicted.predictions.shape == (B * STEPS, S, 128)
        runs[name] = (metrics, predicted.predictions)
    (ref, ref_logits), (got, got_logits) = runs["ref"], runs["plan"]
    assert got["eval_accuracy"] == ref["eval_accuracy"]
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
    torch.testing.assert_close(torch.as_tensor(got_logits), torch.as_tensor(ref_logits))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"per_device_train_batch_size": 2 * B}, f"micro_batch {B} in the plan, {2 * B} in this run"),
        ({"bf16": True}, "precision fp32 in the plan, amp in this run (bf16=True over fp32 weights)"),
        ({"gradient_accumulation_steps": 2}, "keep_grads False in the plan, True in this run"),
    ],
    ids=["batch", "bf16", "accumulation"],
)
def test_a_plan_for_another_step_is_refused_by_the_trainer(
    planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    """The plan was priced for fp32 at micro-batch B: a Trainer that runs bf16 autocast, another batch, or
    accumulates gradients (they stay allocated between micro-batches) is refused in one line naming the
    difference and the flags that plan its own step; nothing is applied."""
    folder, plan_path, _ = planned
    model = build(folder)
    with pytest.raises(ConfigError) as refused:
        transformers.Trainer(
            model=model, args=training_args(tmp_path, **changes), train_dataset=dataset(),
            callbacks=[RecomputeCallback(plan_path)],
        )  # fmt: skip
    message = str(refused.value)
    assert "\n" not in message and named in message and "replan=True" in message
    assert applied_policy(model) is None


def test_replan_plans_the_trainers_own_step(planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    """``replan=True``: the plan is made again for the Trainer's step (bf16 autocast, twice the batch) at the
    plan's budget, then trained with and recorded."""
    folder, _, _ = planned
    args = ["plan", "--model", str(folder), "--analytic", "--seq-len", str(S), "--micro-batch", str(B), "--dtype"]
    plan_path = tmp_path / "plan.json"
    assert main([*args, "fp32", "--device", "cpu", "--cost", "flops", "--budget", "1GiB", "-o", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    model = build(folder)
    callback = RecomputeCallback(plan_path, replan=True)
    args = training_args(tmp_path, bf16=True, per_device_train_batch_size=2 * B, max_steps=1, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback])
    assert callback.plan["workload"]["precision"] == "amp" and callback.plan["workload"]["micro_batch"] == 2 * B
    assert callback.plan["budget"] == plan["budget"] and applied_policy(model) == Policy.from_dict(callback.plan)
    trainer.train()
    assert json.loads((tmp_path / PLAN_FILE).read_text())["workload"]["precision"] == "amp"


def test_fsdp_own_checkpointing_is_refused(planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    folder, plan_path, _ = planned
    args = training_args(tmp_path, fsdp_config={"activation_checkpointing": True})
    with pytest.raises(ConfigError, match=r'^fsdp_config=\{"activation_checkpointing": True\} checkpoints every'):
        prepare(build(folder), args, plan_path)


@pytest.mark.parametrize("log_level", ["passive", "error"])
def test_the_plan_summary_shows_by_default(
    planned: tuple[Path, Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str], log_level: str
) -> None:
    """The callback's one-line summary was logged at INFO, under transformers' default WARNING: never seen. It is
    on stderr once when training begins (the Trainer's processes that log), unless ``log_level`` silences it."""
    from recompute.integrations.hf import summary

    folder, plan_path, plan = planned
    args = training_args(tmp_path, max_steps=1, save_strategy="no", log_level=log_level)
    trainer = transformers.Trainer(
        model=build(folder), args=args, train_dataset=dataset(), callbacks=[RecomputeCallback(plan_path)]
    )
    verbosity = transformers.utils.logging.get_verbosity()
    capsys.readouterr()
    try:
        trainer.train()  # sets transformers' verbosity to log_level
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("recompute: ")]
    line = summary(plan)
    assert line.startswith(f"recompute: {Policy.from_dict(plan).describe()}; chunked loss for 'tiny-qwen'")
    assert " predicted peak " in line
    assert lines == ([] if log_level == "error" else [line])


@pytest.mark.parametrize(
    ("plan", "options", "says"),
    [
        ("block", {"lol": 3}, "unknown options ['lol']; recompute.apply takes layers, attn, mlp, loss, loss_chunk"),
        ("block", {"loss": "partial"}, "loss must be one of full, chunked, got 'partial'"),
        ("block", {"loss_chunk": -1}, "loss_chunk must be a positive integer, got -1"),
        ("block", {"attn": 3}, "attn must be a name (a str), got 3"),
        ("block", {"replan": "yes"}, "replan must be True or False, got 'yes'"),
        ({}, {}, "a policy states its name (none, core_attn"),
    ],
    ids=["unknown option", "loss mode", "loss chunk", "attn", "replan", "empty policy"],
)
def test_the_callback_refuses_bad_options_at_construction(plan: Any, options: dict[str, Any], says: str) -> None:
    """Issue 38: accepted, these failed at the Trainer's construction or first step (``{}`` was read as block)."""
    with pytest.raises(ConfigError) as caught:
        RecomputeCallback(plan, **options)
    assert says in str(caught.value)

"""docs/quickstart.md run as written: its code block executes in a fresh folder, and what its text says happened
is checked against the real objects (the plan fits the GPU, the model carries it, the CLI writes the same)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from recompute.checkpointing import applied_policy
from recompute.cli import main
from recompute.core.hardware import usable_bytes
from recompute.models.identity import model_identity

transformers = pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"


def _code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1, "docs/quickstart.md has one code block, run here as written"
    return blocks[0]


def test_the_quickstart_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    page: dict[str, Any] = {}
    exec(compile(_code(), str(PAGE), "exec"), page)
    printed = capsys.readouterr().out
    plan, model, config = page["plan"], page["model"], page["config"]

    # The plan fits the GPU it names, and says so in what the page prints.
    assert plan.peak <= usable_bytes("rtx4090-24gb")
    assert f"{plan.peak / 2**30:.1f} GiB" in printed and plan.loss in printed
    # "It prints `...` (torch 2.13, transformers 5.24 ...)": the line the page quotes, on the releases it names.
    releases = re.search(r"\(torch (\d+\.\d+), transformers (\d+\.\d+);", PAGE.read_text())
    assert releases is not None, "docs/quickstart.md names the releases its printed line comes from"
    if torch.__version__.startswith(releases[1] + ".") and transformers.__version__.startswith(releases[2] + "."):
        assert f"It prints `{printed.strip()}`" in PAGE.read_text()
    # The file is about this model (its architecture's hash), and apply put the plan and its loss mode on it.
    saved = json.loads(Path("plan.json").read_text())
    assert saved["model"]["hash"] == model_identity(model).hash
    applied = applied_policy(model)
    assert applied is not None and tuple(applied.per_layer(config.num_hidden_layers)) == tuple(plan.layers)
    assert saved["loss"]["mode"] == saved["workload"]["loss"] == plan.loss
    # The forward keeps its signature (the Trainer's remove_unused_columns reads it).
    plain = transformers.AutoModelForCausalLM.from_config(config)
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)

    # "recompute plan --model config.json ... -o plan.json writes the same from the command line."
    config.save_pretrained(tmp_path / "qwen")
    argv = ["plan", "--model", str(tmp_path / "qwen" / "config.json"), "--gpu", "rtx4090-24gb"]
    assert main([*argv, "--seq-len", "4096", "--micro-batch", "8", "-o", "cli.json"]) == 0
    cli = json.loads(Path("cli.json").read_text())
    assert cli["policy"]["layers"] == saved["policy"]["layers"] and cli["loss"] == saved["loss"]
    assert cli["model"]["hash"] == saved["model"]["hash"]

"""``bench``, ``train`` and ``compare-train`` run the class ``--model`` names: a config.json's or a factory's.

Tiny configs of the zoo (``tests/test_zoo.py``), written to files and passed as ``--model``: the class built is
whatever ``AutoModelForCausalLM.from_config`` makes, and the result names it. Nothing builds recompute's GPT or
Llama in its place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from recompute.bench import bench, bench_source
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.core.workload import Workload
from recompute.trace import trace
from recompute.train import TrainConfig, train
from recompute.train.run_files import checkpoints
from test_zoo import ZOO, TinyLM

pytest.importorskip("transformers")

CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}
BENCH = ["--steps", "2", "--warmup", "1", "--seq-len", "32", "--micro-batch", "2", "--device", "cpu"]
TRAIN = ["--steps", "4", "--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--sample-tokens", "4"]
TRAIN += ["--device", "cpu", "--checkpoint-every", "2"]


def byte_factory() -> nn.Module:
    return TinyLM(256)


def small_factory() -> nn.Module:
    return TinyLM(32)


def config_json(kind: str, folder: Path, **changes: Any) -> str:
    """A tiny config of ``kind`` with a vocabulary the byte tokenizer fits (256)."""
    path = folder / f"{kind}.json"
    path.write_text(json.dumps({"model_type": kind, **ZOO[kind], "vocab_size": 256, **changes}))
    return str(path)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_bench_runs_the_config_class(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_json(kind, tmp_path)
    assert main(["bench", "--model", path, *BENCH, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    name = f"transformers.{CLASSES[kind]}"
    assert data["model"] == kind and data["spec"]["class"] == name and data["spec"]["n_layers"] == 2
    assert data["notes"][0] == f"ran {name} built from {path}"
    assert [r["policy"] for r in data["rows"]] == ["none", "block"]


def test_bench_memory_is_the_trace_of_the_same_class(tmp_path: Path) -> None:
    """The predicted peak is the fake trace of the real class, and the real CPU step's equals it to the byte."""
    source = bench_source(config_json("llama", tmp_path))
    wl = Workload(seq_len=32, micro_batch=2, dtype="fp32", device="cpu")
    result = bench(source, wl, ["none", "block"], steps=1, warmup=1)
    for row, policy in zip(result.rows, ("none", "block")):
        assert row.peak == row.predicted_peak == trace(source, wl, policy).peak
    assert result.rows[0].predicted_overhead == 0 and result.rows[1].predicted_overhead > 0  # counted FLOPs
    assert any("predicted overhead: its FLOPs counted (FlopCounterMode)" in n for n in result.notes)
    assert all(row.analytic_peak is None for row in result.rows)  # the formulas describe another class


def test_bench_preset_overhead_is_the_analytic_models(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64"]
    assert main([*argv, *BENCH, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    notes = data["notes"]
    assert notes[0] == "ran recompute.models.GPT built from the gpt2 spec" and any("analytic model" in n for n in notes)
    assert all(row["analytic_peak"] > 0 for row in data["rows"])


def test_bench_runs_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", f"{__name__}:small_factory", "--steps", "1", "--seq-len", "8", "--json"]
    assert main([*argv, "--micro-batch", "2", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["spec"]["class"] == "test_zoo.TinyLM" and data["spec"]["vocab"] == 32
    assert data["notes"][0] == f"ran test_zoo.TinyLM built from {__name__}:small_factory"


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("bench", ["--layers", "1"], "--layers resizes presets; {path} is built as it is"),
        (
            "bench",
            ["--tp", "2"],
            "--tp 2 bench recompute's reference GPT/Llama (recompute.parallel), not {path}; drop --tp 2,",
        ),
        ("train", ["--hidden", "32"], "--hidden resizes presets; {path} is trained as it is"),
        (
            "train",
            ["--tp", "2"],
            "--tp 2 train recompute's reference GPT/Llama (recompute.parallel), not {path}; drop --tp 2,",
        ),
        ("train", ["--seq-len", "128"], "--seq-len 128 exceeds the model's 64 positions"),
    ],
)
def test_what_cannot_apply_is_refused_in_one_line(
    command: str, argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_json("llama", tmp_path)
    assert main([command, "--model", path, *argv, "--device", "cpu", "--out" if command == "train" else "--seed",
                 str(tmp_path / "run") if command == "train" else "0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(path=path) in err, err


def test_train_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    config = TrainConfig.of(model=config_json("llama", tmp_path, vocab_size=128), out=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"makes ids below 256 but .* has a vocabulary of 128; give the model"):
        train(config.replace(device="cpu", steps=1, seq_len=16, micro_batch=1))


@pytest.mark.parametrize("kind", list(CLASSES))
def test_train_saves_and_resumes_bit_identically(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_json(kind, tmp_path)
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert main(["train", "--model", path, *TRAIN, "--policy", "block", "--out", whole]) == 0
    assert f"trained {kind}, transformers.{CLASSES[kind]} built from {path} (block)" in capsys.readouterr().out
    assert main(["train", "--model", path, *TRAIN, "--policy", "block", "--out", part, "--steps", "2"]) == 0
    assert main(["train", "--model", path, *TRAIN, "--policy", "block", "--out", part, "--resume"]) == 0
    rows = [[json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()] for out in (whole, part)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]] and len(rows[0]) == 4
    a, b = (torch.load(checkpoints(Path(out))[-1], weights_only=True)["model"] for out in (whole, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the class's own state dict


def test_resume_with_another_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = config_json("llama", tmp_path), str(tmp_path / "run")
    assert main(["train", "--model", path, *TRAIN, "--steps", "2", "--out", out]) == 0
    config_json("llama", tmp_path, intermediate_size=128)  # the same path, another model
    capsys.readouterr()
    assert main(["train", "--model", path, *TRAIN, "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was written for another model (config sha256:" in err, err


def test_train_runs_a_factory_and_records_it(tmp_path: Path) -> None:
    base = TrainConfig.of(model=f"{__name__}:byte_factory", steps=2, seq_len=16, micro_batch=2, sample_tokens=3)
    result = train(base.replace(out=str(tmp_path / "a"), device="cpu", warmup=1))
    assert result.built == f"test_zoo.TinyLM built from {__name__}:byte_factory" and len(result.losses) == 2
    saved = torch.load(checkpoints(tmp_path / "a")[-1], weights_only=True)["source"]
    assert saved.startswith(f"factory {__name__}:byte_factory sha256:")
    with pytest.raises(ConfigError, match=f"ids below 256 but {__name__}:small_factory has a vocabulary of 32"):
        train(base.replace(model=f"{__name__}:small_factory", out=str(tmp_path / "b"), device="cpu"))


def test_compare_train_runs_the_config_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_json("gpt2", tmp_path)
    argv = ["compare-train", "--model", path, "--policies", "none,block", "--out", str(tmp_path / "cmp"), "--json"]
    assert main([*argv, *TRAIN[:-2], "--checkpoint-every", "0"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["none", "block"] and rows[1]["max_loss_diff"] == 0.0

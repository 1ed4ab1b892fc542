"""Bad input never gets a traceback or a silent wrong answer, and no run starts that cannot fit.

Every case: exit code 2, one line on stderr that says what was expected, nothing on stdout, and (where a
file would be written) nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recompute
import tiny
from recompute import ConfigError, ModelSpec, Policy, Workload
from recompute.cli import main

SMALL = ["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64"]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI; assert a one-line refusal (exit 2, nothing on stdout) and return that line."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


@pytest.fixture
def odd_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "not utf-8": tmp_path / "latin1.json",
        "a list": tmp_path / "list.json",
        "empty": tmp_path / "empty.json",
        "a folder": tmp_path / "folder",
    }
    files["not utf-8"].write_bytes(b'{"name": "caf\xe9"}')
    files["a list"].write_text("[1, 2]")
    files["empty"].write_text("")
    files["a folder"].mkdir()
    return files


@pytest.mark.parametrize("kind", ["not utf-8", "a list", "empty"])
@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--model", "{f}"],
        ["estimate", "--policy", "{f}"],
        ["plan", "--budget", "80GiB", "--cost", "measured", "--bench", "{f}"],
        ["report", "--plan", "{f}", "-o", "{out}"],
        ["report", "--bench", "{f}", "-o", "{out}"],
        ["trace", "--policy", "{f}", "--seq-len", "64"],
        ["verify", *SMALL, "--policy", "{f}"],
    ],
    ids=["config", "policy", "plan bench", "report plan", "report bench", "trace policy", "verify policy"],
)
def test_odd_files_are_one_line(
    argv: list[str], kind: str, odd_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    line = refused(capsys, *(a.format(f=odd_files[kind], out=out) for a in argv))
    assert str(odd_files[kind]) in line
    assert not out.exists()


def test_apply_says_what_it_expected(odd_files: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"apply takes the model .* got a str"):
        recompute.apply("gpt2", "block")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="save_ops must be a sequence of aten op names"):
        Policy(save_ops="aten.mm")  # type: ignore[arg-type]
    from recompute.models import build_model

    model = build_model(tiny.tiny_gpt())
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        recompute.apply(model, odd_files["not utf-8"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
        (["--micro-batch", "0"], "--micro-batch must be a positive integer, got 0"),
        (["--seq-len", "5000"], "--seq-len 5000 exceeds gpt2's 1024 positions"),
        (["--device", "cuda"], "--device cuda needs a CUDA build of PyTorch"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ],
)
def test_verify_refuses_before_building(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    assert says in refused(capsys, "verify", *SMALL, *argv)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["validate", "--seq-lens", "abc"], "--seq-lens takes positive whole numbers of tokens"),
        (["validate", "--seq-lens", "64.5"], "got '64.5'"),
        (["validate", "--models", ""], "--models '' names nothing to check"),
        (["compare-train", "--policies", ""], "--policies '' names no policy"),
        (["compare-train", "--policies", "none,block,none"], "names 'none' more than once"),
        (["estimate", "--first", "100"], "--first 100 exceeds the model's 12 layers; use --first <= 12"),
        (["estimate", "--every", "0"], "--every must be a positive integer, got 0"),
        (["estimate", "--micro-batch", "100000000000"], "--micro-batch must be at most 1,048,576"),
        (["estimate", "--micro-batch", "1e30"], "invalid int value: '1e30'"),
        (["bench", "--model", "llama3.1-405b"], "`recompute trace` (fake tensors, any size) or `recompute estimate`"),
        (["bench", "--seed", str(10**23)], "--seed must be an integer from -2^63 to 2^64 - 1"),
        (["verify", "--seed", str(10**23)], "--seed must be an integer from -2^63 to 2^64 - 1"),
        (["train", "--seed", str(10**23)], "--seed must be an integer from -2^63 to 2^64 - 1"),
        (["compare-train", "--grad-accum", str(10**11)], "--grad-accum must be at most 1,048,576"),
        (["train", "--sample-tokens", str(10**11)], "--sample-tokens must be at most 65,536"),
        (["train", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["train", "--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
        (["compare-train", "--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
        (["train", "--grad-clip", "-1"], "--grad-clip must be a finite number >= 0, got -1.0"),
        (["trace", "--scale-from", "0"], "--scale-from must be a positive integer, got 0"),
    ],
)
def test_wrong_values_are_refused_with_the_limit(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert says in refused(capsys, *argv)
    assert list(tmp_path.iterdir()) == []


def test_output_paths_are_checked_before_the_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert "is a file, not a folder; give a folder" in refused(capsys, "train", "--out", str(afile))
    run = ["compare-train", "--out", str(tmp_path / "runs"), "--steps", "1"]
    assert "--png" in refused(capsys, *run, "--png", str(tmp_path))
    assert "does not exist; create it first" in refused(capsys, *run, "--png", str(tmp_path / "no" / "x.png"))
    assert "does not exist" in refused(capsys, "plan", "--budget", "80GiB", "-o", str(tmp_path / "no" / "p.json"))
    assert not (tmp_path / "runs").exists()


def test_compare_train_checks_every_plan_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    Policy(layers=("block",) * 4, model="gpt2-medium").save(plan)  # compare-train's default: 4 layers
    line = refused(capsys, "compare-train", "--out", str(tmp_path / "runs"), "--policies", f"none,{plan}")
    assert "the plan was made for 'gpt2-medium' but this model is 'gpt2'" in line
    assert not (tmp_path / "runs").exists()


def test_measured_costs_of_another_model_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, wl = ModelSpec.from_name("gpt2-medium"), Workload(seq_len=512)
    bench = tiny.write_bench(tmp_path / "b.json", spec, wl, {"none": 1.0, "block": 1.3})
    line = refused(capsys, "plan", "--model", "gpt2", "--budget", "8GiB", "--cost", "measured", "--bench", str(bench))
    assert "are for model 'gpt2-medium', not 'gpt2'" in line


@pytest.mark.parametrize("command", ["bench", "verify"])
def test_a_step_that_cannot_fit_is_refused_before_it_starts(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """s = 131072 on a small Llama would take hundreds of GiB: refused at once with the figures and a fix."""
    line = refused(
        capsys, command, "--model", "llama3.1-8b", "--layers", "2", "--hidden", "256", "--heads", "8", "--seq-len",
        "131072",
    )  # fmt: skip
    assert f"{command} needs about " in line and "GiB is available on cpu" in line and "--seq-len" in line


def test_the_memory_check_reads_what_is_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("recompute.runtime.available_memory", lambda device: 2**20)  # 1 MiB free
    line = refused(capsys, "bench", *SMALL, "--seq-len", "64", "--steps", "1", "--warmup", "0")
    assert "but 1.0 MiB is available on cpu" in line


def test_verify_with_one_seed_is_repeatable(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for _ in range(2):
        assert main(["verify", *SMALL, "--seq-len", "16", "--seed", "3", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["loss_ref"] == runs[1]["loss_ref"] and runs[0]["loss"] == runs[1]["loss"]

"""`recompute estimate`: table and JSON carry the analytic numbers; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recompute import ModelSpec, Workload, estimate
from recompute.cli import main
from recompute.core.policy import POLICIES


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exits (--help, usage errors)
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_table_has_a_row_per_policy_and_a_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "--model", "llama3.1-8b", "--seq-len", "8192", "--policy", "core_attn")
    assert code == 0 and all(line.startswith("time model: ") for line in err.splitlines())  # progress only
    lines = out.splitlines()
    for name in POLICIES:
        assert any(line.startswith(name + " ") for line in lines), name
    assert "breakdown of core_attn" in out and "saved per 1% FLOPs" in out and "per 1% time" in out


@pytest.mark.parametrize("policy", list(POLICIES))
def test_json_equals_the_library(capsys: pytest.CaptureFixture[str], policy: str) -> None:
    argv = ["estimate", "--model", "llama3.1-70b", "--seq-len", "4096", "--tp", "8", "--sp", "--pp", "4"]
    code, out, _ = run(capsys, *argv, "--policy", policy, "--json")
    assert code == 0
    data = json.loads(out)
    expected = estimate(ModelSpec.from_name("llama3.1-70b"), Workload(seq_len=4096, tp=8, sp=True, pp=4), policy)
    assert data["chosen"]["peak"] == expected.peak
    assert data["chosen"]["activation_bytes"] == expected.activation_bytes
    assert data["chosen"]["overhead"] == expected.overhead
    assert [row["policy"] for row in data["policies"]] == list(POLICIES)


def test_every_and_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--policy", "block", "--every", "3", "--json")
    assert code == 0
    assert json.loads(out)["chosen"]["per_layer"][:4] == ["block", "none", "none", "block"]


def test_plan_file_as_policy(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": ["block"] * 6 + ["none"] * 6, "model": "gpt2"}))
    code, out, _ = run(capsys, "estimate", "--policy", str(plan), "--json")
    assert code == 0 and json.loads(out)["chosen"]["per_layer"].count("block") == 6


def test_a_config_path_is_not_estimated_as_a_proxy(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    cfg = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelSpec.from_hf_config(tmp_path / "config.json").name == "gpt2"  # the shape reads
    code, out, err = run(capsys, "estimate", "--model", str(tmp_path / "config.json"), "--analytic", "--json")
    assert code == 0, err  # the closed form of transformers' GPT-2, not recompute's reference model
    assert json.loads(out)["model"]["mlp"] == "gelu_new"
    cfg.update(model_type="deepseek_v3", kv_lora_rank=512)  # latent attention: not modelled
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = run(capsys, "estimate", "--model", str(tmp_path / "config.json"), "--analytic", "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1  # no dense guess
    assert "recompute profile" in err


BAD_INPUT = {
    "unknown model": ["--model", "gpt5"],
    "unknown policy": ["--policy", "sometimes"],
    "zero seq len": ["--seq-len", "0"],
    "negative micro-batch": ["--micro-batch", "-2"],
    "non-integer seq len": ["--seq-len", "lots"],
    "unknown dtype": ["--dtype", "int8"],
    "unknown precision": ["--precision", "fp8"],
    "unknown attention": ["--attention", "magic"],
    "tp does not divide heads": ["--tp", "5"],
    "tp does not divide kv heads": ["--model", "llama3.1-8b", "--tp", "16"],
    "pipeline deeper than layers": ["--pp", "13"],
    "sequence beyond positions": ["--seq-len", "4096"],
    "sp with indivisible sequence": ["--model", "llama3.1-8b", "--tp", "8", "--sp", "--seq-len", "1001"],
    "interleave without pipeline": ["--interleave", "2"],
    "every zero": ["--every", "0"],
    "every with first": ["--every", "2", "--first", "3"],
    "missing plan file": ["--policy", "no-such-plan.json"],
    "zero data parallel": ["--dp", "0"],
    "unknown option": ["--frobnicate"],
}


@pytest.mark.parametrize("argv", list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, "estimate", *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err and "Traceback" not in err


def test_corrupt_plan_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "estimate", "--policy", str(bad))
    assert code == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1


def test_plan_for_another_layer_count(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": ["block"] * 32}))
    code, _, err = run(capsys, "estimate", "--policy", str(plan))
    assert code == 2 and "lists 32 layers but the model has 12" in err


def test_console_script_runs_without_importing_torch() -> None:
    """Without times (tensor parallelism is priced in time too now, from a trace the first time)."""
    code = (
        "import sys; from recompute.cli import main; "
        "rc = main(['estimate', '--model', 'llama3.1-405b', '--seq-len', '8192', '--tp', '8', '--sp', '--json', "
        "'--no-time']); "
        "assert 'torch' not in sys.modules, 'estimate imported torch'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"]["name"] == "llama3.1-405b"


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.cli import COMMANDS, main

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in COMMANDS)


def test_top_level_help_loads_no_command() -> None:
    """``recompute --help`` lists the commands without importing any of them (it took 10 s when it built them all,
    issue 39), and ``import recompute`` loads neither torch nor the API until a name is used."""
    code = (
        "import sys, contextlib, io; import recompute; from recompute.cli import main\n"
        "assert 'recompute.api' not in sys.modules, 'import recompute loaded the API'\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(['--help'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('recompute.cli.') and m != 'recompute.cli._common')\n"
        "assert 'torch' not in sys.modules and not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["estimate", "plan", "profile", "report"])
def test_a_mistyped_model_is_refused_before_torch_loads(command: str) -> None:
    """A name that is no preset, path or factory gets its one line (exit 2) at once: it took 4.6 s, the time to
    import torch and the trace, to say so."""
    code = (
        "import sys; from recompute.cli import main; rc = main([sys.argv[1], '--model', 'gpt2-small']); "
        "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "'gpt2-small' is not a known model" in done.stderr


@pytest.mark.parametrize("command", ["estimate", "plan", "report"])
def test_torch_free_commands_import_no_torch(command: str) -> None:
    """Only the command asked for is loaded: estimate, plan and report start without torch."""
    code = (
        "import sys; from recompute.cli import build_parser; build_parser(sys.argv[1]); "
        "assert 'torch' not in sys.modules, 'imported torch'"
    )
    done = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


COMMON_ROW = {"policy", "per_layer", "peak", "peak_phase", "activation_bytes", "recompute_flops", "host"}
"""The fields every estimate row has, whatever the model source (docs/json.md)."""


def test_json_has_one_shape_for_every_model_source(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96}
    config |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = []
    for model in ("gpt2", str(tmp_path / "config.json")):
        code, out, _ = run(capsys, "estimate", "--model", model, "--seq-len", "64", "--no-time", "--json")
        assert code == 0
        data = json.loads(out)
        assert data["format"] == "recompute.estimate/2" and data["workload"]["seq_len"] == 64
        assert [row["policy"] for row in data["policies"]][:6] == list(POLICIES)
        for row in [*data["policies"], data["chosen"]]:
            assert set(row) >= COMMON_ROW, COMMON_ROW - set(row)
            assert row["peak"] > 0 and len(row["per_layer"]) in (2, 12)
        shapes.append((data["source"], set(data) - {"profile"}))
    assert shapes == [("analytic", shapes[0][1]), ("profile", shapes[0][1])]

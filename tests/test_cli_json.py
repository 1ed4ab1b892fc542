"""Every command's ``--json`` names its shape in ``format`` (docs/json.md) and has one shape for every model
source: a preset and a transformers config.json give the same keys (issue 36; ``estimate``'s own test is
``test_cli_estimate.py::test_json_has_one_shape_for_every_model_source``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from recompute.cli import build_parser, main
from recompute.cli._common import JSON_FORMATS

sys.path.insert(0, str(Path(__file__).parent))
from test_zoo import config_json

STEP = ["--seq-len", "32", "--micro-batch", "2", "--device", "cpu"]
SHRUNK = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128"]
"""A preset shrunk to the tiny config's size (``bench`` and ``verify`` build it for real)."""
COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "plan": (["--dtype", "fp32", "--cost", "flops", "--budget", "1e15"], []),
    "trace": (["--dtype", "fp32", "--policy", "block", "--scale-from", "1"], []),
    "verify": (["--policy", "block"], SHRUNK),
    "bench": (["--policies", "none,block", "--steps", "1", "--warmup", "0", "--no-time"], SHRUNK),
}
"""Command -> its options, and what the preset takes besides (its size)."""


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(config_json("llama", tmp_path_factory.mktemp("json")))


def json_of(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code in (0, 1), err  # verify exits 1 when a policy changes the gradients; its JSON is still printed
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


DESCRIBED = ("spec",)
"""Fields that describe the model in its source's terms (docs/json.md): a preset's ``ModelSpec``, a built class's
summary; their keys differ by design."""


def shape(data: Any, depth: int = 2) -> Any:
    """The keys of ``data``, nested ``depth`` levels (a list by its first item), ``DESCRIBED`` by presence only."""
    if depth == 0:
        return None
    if isinstance(data, dict):
        return {k: None if k in DESCRIBED else shape(v, depth - 1) for k, v in data.items()}
    if isinstance(data, list) and data:
        return [shape(data[0], depth - 1)]
    return None


@pytest.mark.parametrize("command", list(COMMANDS))
def test_json_has_one_shape_for_every_model_source(
    command: str, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options, preset_size = COMMANDS[command]
    preset = json_of(capsys, command, "--model", "llama3.1-8b", *STEP, *options, *preset_size, "--json")
    profiled = json_of(capsys, command, "--model", config, *STEP, *options, "--json")
    assert preset["format"] == profiled["format"] == JSON_FORMATS[command]
    assert next(iter(preset)) == "format"
    assert shape(preset) == shape(profiled), command


def test_every_command_with_json_names_its_format() -> None:
    """A command that prints ``--json`` has a format in ``JSON_FORMATS``, and docs/json.md documents each one."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    with_json = {name for name, p in commands.items() if any(a.dest == "json" for a in p._actions)}
    named = {name.split()[0] for name in JSON_FORMATS}
    assert with_json == named
    docs = (Path(__file__).parents[1] / "docs" / "json.md").read_text()
    for name in JSON_FORMATS.values():
        assert f"`{name}`" in docs, name
    for command in named:
        assert re.search(rf"^## `{re.escape(command)} --json`", docs, re.M), command


@pytest.mark.slow
def test_profile_json_has_one_shape_for_a_config_and_a_factory(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``profile --json`` is the profile file for any model (a preset's profile takes minutes here: a config.json
    and a factory stand for the sources)."""
    options = [*STEP, "--dtype", "fp32", "--no-time", "--json"]
    from_config = json_of(capsys, "profile", "--model", config, *options)
    from_factory = json_of(capsys, "profile", "--model", "test_real_runs:small_factory", *options)
    assert from_config["format"] == from_factory["format"] == JSON_FORMATS["profile"]
    assert shape(from_config, 1) == shape(from_factory, 1)
    assert shape(from_config["kinds"][0], 1) == shape(from_factory["kinds"][0], 1)

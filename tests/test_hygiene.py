"""Commands write only where they are asked to: run from an empty folder, that folder stays empty.

(Stray ``out.N``/``err.N`` files once reached the repository's root; this keeps any command from adding more.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recompute.cli import main

SHRUNK = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64"]

COMMANDS = {
    "estimate": ["estimate", "--model", "gpt2", "--seq-len", "512", "--json"],
    "plan": ["plan", "--model", "gpt2", "--seq-len", "512", "--budget", "4GiB"],
    "trace": ["trace", "--model", "gpt2", "--seq-len", "64", "--scale-from", "1", "--policy", "block"],
    "validate": ["validate", "--models", "gpt2", "--policies", "block", "--attention", "flash", "--seq-lens", "64"],
    "verify": ["verify", "--model", "gpt2", *SHRUNK, "--seq-len", "16", "--policy", "block"],
    "bench": ["bench", "--model", "gpt2", *SHRUNK, "--seq-len", "16", "--steps", "1", "--warmup", "0"],
    "bad input": ["estimate", "--model", "no-such-model"],
}


@pytest.mark.parametrize("argv", list(COMMANDS.values()), ids=list(COMMANDS))
def test_a_command_writes_nothing_it_was_not_asked_to(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "cwd"
    empty.mkdir()
    monkeypatch.chdir(empty)
    code = main(argv)
    capsys.readouterr()
    assert code in (0, 2)
    assert sorted(p.name for p in empty.rglob("*")) == []


def test_asked_outputs_are_the_only_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "gpt2", "--seq-len", "512", "--budget", "4GiB", "-o", "plan.json"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]

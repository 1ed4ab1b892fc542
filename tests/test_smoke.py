"""Every ``recompute`` command runs at a tiny size under the torch of this test run (``tests/smoke.py``): part of
the fast tests that CI runs under the oldest supported torch too (``scripts/check-oldest-torch``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import smoke
from recompute.cli import main

pytest.importorskip("transformers")

SLOW = {"calibrate --quick", "bench config", "profile config", "plan config"}
"""Tens of seconds each on this 2-core machine: left to the full suite and ``scripts/torch-matrix``."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("smoke")
    smoke.write_files(path)
    return path


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in smoke.COMMANDS])
def test_every_command_runs(
    name: str, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(folder)
    argv = smoke.argv(name, folder)
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    if "--json" in argv:
        assert json.loads(out)
    else:
        assert out.strip()

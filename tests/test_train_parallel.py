"""``recompute train --tp/--sp/--dp`` under torchrun: one process's losses, exact resume, rank 0 writes.

The 2-rank runs happen in one torchrun launch (``tests/dist/train_worker.py``, gloo on the CPU), which reports
what ``train()`` returned on every rank and the files the runs left; the single-process reference and the
error cases run in this process. Dropout is 0 wherever losses are compared with one process: each rank draws
its own dropout masks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from recompute.cli import build_parser, main
from recompute.cli.train import _config
from recompute.core.errors import ConfigError
from recompute.train import RunResult, TrainConfig, train
from tiny import TRAIN

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = Path(__file__).parent / "dist" / "train_worker.py"
STEPS, KILL_AFTER = 6, 4  # checkpoints after steps 3 and 6; the worker stops one run after step 5 (index 4)
RESUME_DROPOUT = 0.1  # the stopped and resumed run has dropout on: each rank's RNG state must come back too
FLIP = "model.layers.0.attn.c_attn.weight"  # column-parallel: rank 1's shard is its own, in __1_0.distcp
# The shared tiny GPT-2 (tests/tiny.py), at dropout 0, checkpointing every 3 steps (both kept).
TINY = {**TRAIN, "steps": STEPS, "dropout": 0.0, "checkpoint_every": 3, "keep": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's report: ``ranks`` (what each rank's runs returned) and ``files`` (rank 0's view)."""
    root = tmp_path_factory.mktemp("train-parallel")
    out = root / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    cmd += ["--config", json.dumps(TINY), "--kill-after", str(KILL_AFTER), "--resume-dropout", str(RESUME_DROPOUT)]
    cmd += ["--flip", FLIP]
    cmd += ["--dir", str(root), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {**json.loads(out.read_text()), "root": root}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The same run in one process."""
    out = tmp_path_factory.mktemp("train-one-process")
    return train(TrainConfig.of(**TINY, out=str(out)))  # type: ignore[arg-type]


def per_rank(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in runs["ranks"]]


@pytest.mark.parametrize("name", ["whole", "dp"], ids=["tp2+sp", "dp2"])
def test_losses_match_one_process(runs: dict[str, Any], reference: RunResult, name: str) -> None:
    """``--tp 2 --sp`` and ``--dp 2`` (half the micro-batch on each rank): one process's losses."""
    for rank, r in enumerate(per_rank(runs, name)):
        assert r["code"] == 0 and r["run"]["rank"] == rank
        losses = torch.tensor(r["run"]["losses"])
        torch.testing.assert_close(losses, torch.tensor(reference.losses), rtol=1e-5, atol=0)
    first, second = (r["run"]["losses"] for r in per_rank(runs, name))
    assert first == second  # the same reported loss on every rank
    assert runs["files"][name]["metric_losses"] == first


def test_resume_under_tp_continues_exactly(runs: dict[str, Any]) -> None:
    """With dropout on: the same shards, optimizer state, per-rank RNG state and data order."""
    whole = per_rank(runs, "dropout")[0]["run"]["losses"]
    assert whole != per_rank(runs, "whole")[0]["run"]["losses"]  # dropout is on
    for r in per_rank(runs, "resumed"):
        assert r["killed"] and r["checkpoints_after_kill"] == ["step_0000003"]
        assert r["run"]["resumed_from"] == 3
        assert r["run"]["losses"] == whole  # bit-exact
    files = runs["files"]["resumed"]
    assert files["metric_steps"] == list(range(STEPS)) and files["metric_losses"] == whole


def test_sharded_checkpoints_are_whole_folders_kept_to_the_newest(runs: dict[str, Any]) -> None:
    each = [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums_rank0.json", "checksums_rank1.json", "run.json"]
    for name in ("whole", "dropout", "resumed", "dp"):
        files = runs["files"][name]
        assert files["checkpoints"] == ["step_0000003", "step_0000006"] and not files["leftovers"], name
        assert files["checkpoint_files"] == {"step_0000003": each, "step_0000006": each}


def test_resume_passes_over_a_shard_with_a_flipped_bit(runs: dict[str, Any]) -> None:
    """Rank 1 alone finds the flipped bit; every rank passes over the checkpoint, rank 0 says so."""
    whole = per_rank(runs, "dropout")[0]["run"]["losses"]
    for rank, r in enumerate(per_rank(runs, "fallback")):
        assert r["code"] == 0 and r["run"]["resumed_from"] == 3 and r["run"]["losses"] == whole
        notes = [line for line in r["stderr"].splitlines() if not line.startswith("train: ")]  # not progress
        assert len(notes) == (1 if rank == 0 else 0), notes
    expected = (
        f"step_0000006' is damaged: tensor '{FLIP}' (rank 1's shard) does not match its stored CRC-32; "
        "resuming from the older '"
    )
    assert expected in per_rank(runs, "fallback")[0]["stderr"]
    assert runs["files"]["dropout"]["metric_losses"] == whole  # rewritten from step 3's checkpoint, then appended


def test_resume_refuses_when_no_sharded_checkpoint_verifies(runs: dict[str, Any]) -> None:
    for r in per_rank(runs, "refused"):
        lines = r["stderr"].strip().splitlines()
        assert r["code"] == 2 and len(lines) == 1, lines
        assert f"step_0000006' is damaged: tensor '{FLIP}' (rank 1's shard)" in lines[0]
        assert lines[0].endswith("no older one verifies either (1); start over with --overwrite instead of --resume")


def test_rank_0_alone_writes_metrics_and_sample(runs: dict[str, Any], reference: RunResult) -> None:
    assert [r["metric_writes"] for r in per_rank(runs, "dp")] == [STEPS, 0]
    assert runs["files"]["dp"]["metric_steps"] == list(range(STEPS))
    assert runs["files"]["dp"]["sample_written"]
    samples = {r["run"]["sample"] for name in ("whole", "dp") for r in per_rank(runs, name)}
    assert samples == {reference.sample}  # with SP the prompt is padded to a multiple of t: the causal mask hides it


def test_one_process_refuses_a_tensor_parallel_checkpoint(runs: dict[str, Any]) -> None:
    config = TrainConfig.of(**TINY, out=str(runs["root"] / "whole"), resume=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"step_0000006' was written by a different run \(tp: 2 -> 1, sp: True"):
        train(config)


# --- without torchrun, and bad options ----------------------------------------------------------------------

BAD = {
    "tp without torchrun": (["--tp", "2"], "--tp 2 needs torchrun: torchrun --nproc-per-node 2 -m recompute train"),
    "dp without torchrun": (["--dp", "2"], "--dp 2 needs torchrun: torchrun --nproc-per-node 2"),
    "sp without tp": (["--sp"], "--sp splits the sequence over the --tp ranks"),
    "tp not dividing heads": (["--tp", "3"], "--tp 3 must divide the 4 query heads"),
    "sp not dividing seq": (["--tp", "2", "--sp", "--seq-len", "33"], r"sequence length \(33\) must be divisible"),
    "fp16 without a scaler": (["--dtype", "fp16"], "--dtype fp16 would need a gradient scaler"),
}


@pytest.mark.parametrize(("argv", "message"), list(BAD.values()), ids=list(BAD))
def test_bad_parallel_options_exit_2_with_one_line(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    config = TrainConfig.of(**TINY, out=str(tmp_path))  # type: ignore[arg-type]
    assert main([*config.command_line(), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(message, err[0]), err[0]


def test_command_line_gives_back_the_config() -> None:
    config = TrainConfig.of(**TINY, tp=2, sp=True, out="runs/x y")  # type: ignore[arg-type]
    args = build_parser().parse_args(config.command_line())
    assert args.loss is None  # not given: the plan's loss mode, else full (recompute train resolves it)
    args.loss = "full"
    assert _config(args) == config

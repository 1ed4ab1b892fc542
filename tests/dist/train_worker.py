"""``recompute train`` with --tp/--sp/--dp, run on every rank under torchrun (driven by tests/test_train_parallel.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/train_worker.py \\
        --config '{"n_layers": 2, ...}' --kill-after 4 --resume-dropout 0.1 --dir DIR --out r.json

With 2 ranks, from one TrainConfig (``--config``, as JSON; the caller keeps dropout at 0):

- ``whole``: the CLI, ``recompute train --tp 2 --sp ...`` (it starts the process group; the others reuse it);
- ``dropout``: the same through ``train()`` with dropout ``--resume-dropout`` (each rank's masks its own);
- ``resumed``: that run again, stopped by an exception after step ``--kill-after`` (the last checkpoint is
  older), then continued with the CLI's ``--resume``;
- ``dp``: the CLI with ``--dp 2``, counting who writes ``metrics.jsonl``.

Every rank records what its ``train()`` returned; rank 0 writes them all, per rank, with the files it finds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

import recompute.train.loop as loop
from recompute.cli import main
from recompute.train import TrainConfig
from recompute.train.checkpoint import checkpoints


class Killed(Exception):
    pass


class Recorder:
    """Wraps ``train`` (the CLI's too) and ``_write_metrics``: what each run returned, who wrote metrics."""

    def __init__(self) -> None:
        self.results: list[loop.RunResult] = []
        self.metric_writes = 0
        train, write = loop.train, loop._write_metrics

        def recorded_train(*args: Any, **kwargs: Any) -> loop.RunResult:
            result = train(*args, **kwargs)
            self.results.append(result)
            return result

        def counted_write(*args: Any) -> None:
            self.metric_writes += 1
            write(*args)

        loop.train, loop._write_metrics = recorded_train, counted_write  # type: ignore[assignment]

    def last(self) -> dict[str, Any]:
        r = self.results[-1]
        return {"rank": r.rank, "losses": r.losses, "resumed_from": r.resumed_from, "sample": r.sample}


def files(out: Path) -> dict[str, Any]:
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    return {
        "metric_steps": [json.loads(line)["step"] for line in metrics],
        "metric_losses": [json.loads(line)["loss"] for line in metrics],
        "checkpoints": [p.name for p in checkpoints(out)],
        "checkpoint_files": {p.name: sorted(f.name for f in p.iterdir()) for p in checkpoints(out)},
        "leftovers": sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")),
        "sample_written": (out / "sample.txt").exists(),
    }


def run(config: TrainConfig, kill_after: int, resume_dropout: float, root: Path) -> dict[str, Any]:
    rec, report = Recorder(), {}
    tp = config.replace(tp=2, sp=True)

    whole = tp.replace(out=str(root / "whole"))
    code = main(whole.command_line())  # no process group yet: train() starts it, later runs reuse it
    report["whole"] = {"code": code, "run": rec.last()}

    with_dropout = tp.replace(dropout=resume_dropout, out=str(root / "dropout"))
    loop.train(with_dropout, quiet=True)
    report["dropout"] = {"run": rec.last()}

    def kill(step: int) -> None:
        if step == kill_after:
            raise Killed

    resumed = with_dropout.replace(out=str(root / "resumed"))
    try:
        loop.train(resumed, on_step=kill, quiet=True)
        killed = False
    except Killed:
        killed = True
    dist.barrier()
    after_kill = [p.name for p in checkpoints(Path(resumed.out))]
    main(resumed.replace(resume=True).command_line())
    report["resumed"] = {"run": rec.last(), "killed": killed, "checkpoints_after_kill": after_kill}

    writes_before = rec.metric_writes
    dp = config.replace(dp=2, out=str(root / "dp"))
    code = main(dp.command_line())
    report["dp"] = {"code": code, "run": rec.last(), "metric_writes": rec.metric_writes - writes_before}
    return report


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="TrainConfig fields as JSON")
    p.add_argument("--kill-after", type=int, required=True, help="the step after which to stop the resumed run")
    p.add_argument("--resume-dropout", type=float, required=True, help="dropout of the stopped and resumed runs")
    p.add_argument("--dir", required=True, help="where the runs write")
    p.add_argument("--out", required=True, help="the JSON report (rank 0)")
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    root = Path(args.dir)
    report = run(TrainConfig(**json.loads(args.config)), args.kill_after, args.resume_dropout, root)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, report)
    if dist.get_rank() == 0:
        names = ("whole", "dropout", "resumed", "dp")
        result = {"ranks": per_rank, "files": {name: files(root / name) for name in names}}
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()

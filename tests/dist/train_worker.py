"""``recompute train`` with --tp/--sp/--dp, run on every rank under torchrun (driven by tests/test_train_parallel.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/train_worker.py \\
        --config '{"n_layers": 2, ...}' --kill-after 4 --resume-dropout 0.1 \\
        --flip model.layers.0.attn.c_attn.weight --dir DIR --out r.json

With 2 ranks, from one TrainConfig (``--config``, as JSON; the caller keeps dropout at 0):

- ``whole``: the CLI, ``recompute train --tp 2 --sp ...`` (it starts the process group; the others reuse it);
- ``dropout``: the same through ``train()`` with dropout ``--resume-dropout`` (each rank's masks its own);
- ``resumed``: that run again, stopped by an exception after step ``--kill-after`` (the last checkpoint is
  older), then continued with the CLI's ``--resume``;
- ``fallback``: one bit flipped in rank 1's shard of a weight in the ``dropout`` run's newest checkpoint
  (``--flip``), then the CLI's ``--resume`` (it must pass over that checkpoint for the older one);
- ``refused``: a bit flipped in both of its checkpoints, then ``--resume`` again (it must stop, exit code 2);
- ``dp``: the CLI with ``--dp 2``, counting who writes ``metrics.jsonl``.

Every rank records what its ``train()`` returned; rank 0 writes them all, per rank, with the files it finds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import recompute.train.loop as loop
from recompute.cli import main
from recompute.train import TrainConfig, read_metrics
from recompute.train.checkpoint import checkpoints
from recompute.parallel import end_process_group


class Killed(Exception):
    pass


class Recorder:
    """Wraps ``train`` (the CLI's too) and ``append_metrics``: what each run returned, who wrote metrics."""

    def __init__(self) -> None:
        self.results: list[loop.RunResult] = []
        self.metric_writes = 0
        train, write = loop.train, loop.append_metrics

        def recorded_train(*args: Any, **kwargs: Any) -> loop.RunResult:
            result = train(*args, **kwargs)
            self.results.append(result)
            return result

        def counted_write(*args: Any) -> None:
            self.metric_writes += 1
            write(*args)

        loop.train, loop.append_metrics = recorded_train, counted_write  # type: ignore[assignment]

    def last(self) -> dict[str, Any]:
        r = self.results[-1]
        return {"rank": r.rank, "losses": r.losses, "resumed_from": r.resumed_from, "sample": r.sample}


def files(out: Path) -> dict[str, Any]:
    metrics = read_metrics(out / "metrics.jsonl")
    return {
        "metric_steps": [m["step"] for m in metrics],
        "metric_losses": [m["loss"] for m in metrics],
        "checkpoints": [p.name for p in checkpoints(out)],
        "checkpoint_files": {p.name: sorted(f.name for f in p.iterdir()) for p in checkpoints(out)},
        "leftovers": sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")),
        "sample_written": (out / "sample.txt").exists(),
    }


def flip_bit(folder: Path, fqn: str, rank: int) -> None:
    """Flip one bit in the middle of ``rank``'s shard of ``fqn`` in a DCP folder (rank 0 alone; checksums stay).

    DCP's metadata says where the shard's record lies; the shard's bytes are found inside it by content.
    """
    if dist.get_rank() == 0:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
        name = f"__{rank}_0.distcp"
        (info,) = [v for k, v in storage.items() if k.fqn == fqn and v.relative_path == name]
        raw = bytearray((folder / name).read_bytes())
        record = raw[info.offset : info.offset + info.length]
        data = torch.load(io.BytesIO(record), weights_only=True).contiguous().numpy().tobytes()
        at = info.offset + record.find(data) + len(data) // 2
        raw[at] ^= 0x04
        (folder / name).write_bytes(raw)
    dist.barrier()


def resume_with_stderr(config: TrainConfig) -> tuple[int, str]:
    """The CLI's ``--resume``; its exit code and what it printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(config.replace(resume=True).command_line())
    return code, err.getvalue()


def run(config: TrainConfig, kill_after: int, resume_dropout: float, flip: str, root: Path) -> dict[str, Any]:
    rec, report = Recorder(), {}
    tp = config.replace(tp=2, sp=True)

    whole = tp.replace(out=str(root / "whole"))
    code = main(whole.command_line())  # no process group yet: train() starts it, later runs reuse it
    report["whole"] = {"code": code, "run": rec.last()}

    with_dropout = tp.replace(dropout=resume_dropout, out=str(root / "dropout"))
    loop.train(with_dropout)
    report["dropout"] = {"run": rec.last()}

    def kill(step: int) -> None:
        if step == kill_after:
            raise Killed

    resumed = with_dropout.replace(out=str(root / "resumed"))
    try:
        loop.train(resumed, on_step=kill)
        killed = False
    except Killed:
        killed = True
    dist.barrier()
    after_kill = [p.name for p in checkpoints(Path(resumed.out))]
    main(resumed.replace(resume=True).command_line())
    report["resumed"] = {"run": rec.last(), "killed": killed, "checkpoints_after_kill": after_kill}

    older, newest = checkpoints(Path(with_dropout.out))
    flip_bit(newest, flip, rank=1)
    code, err = resume_with_stderr(with_dropout)
    report["fallback"] = {"code": code, "run": rec.last(), "stderr": err}
    for folder in (older, newest):
        flip_bit(folder, flip, rank=1)
    code, err = resume_with_stderr(with_dropout)
    report["refused"] = {"code": code, "stderr": err}

    writes_before = rec.metric_writes
    dp = config.replace(dp=2, micro_batch=config.micro_batch // 2, out=str(root / "dp"))  # the same rows in all
    code = main(dp.command_line())
    report["dp"] = {"code": code, "run": rec.last(), "metric_writes": rec.metric_writes - writes_before}
    return report


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="TrainConfig fields as JSON")
    p.add_argument("--kill-after", type=int, required=True, help="the step after which to stop the resumed run")
    p.add_argument("--resume-dropout", type=float, required=True, help="dropout of the stopped and resumed runs")
    p.add_argument("--flip", required=True, help="the tensor whose shard on rank 1 gets a bit flipped")
    p.add_argument("--dir", required=True, help="where the runs write")
    p.add_argument("--out", required=True, help="the JSON report (rank 0)")
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    root = Path(args.dir)
    report = run(TrainConfig.of(**json.loads(args.config)), args.kill_after, args.resume_dropout, args.flip, root)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, report)
    if dist.get_rank() == 0:
        names = ("whole", "dropout", "resumed", "dp")
        result = {"ranks": per_rank, "files": {name: files(root / name) for name in names}}
        Path(args.out).write_text(json.dumps(result))
    end_process_group()  # every rank waits for the others, then the group ends (parallel/_env.py)

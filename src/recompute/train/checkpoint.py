"""Training checkpoints: written atomically, read back exactly, refused loudly when unusable.

A checkpoint holds the model and optimizer state, the step, the RNG state (so dropout continues as if the
run had not stopped), the config (a resumed run must match it) and the metrics so far.

One process writes one file, ``checkpoints/step_{step}.pt`` (``torch.save``). A torchrun run (``--tp``/``--dp``)
writes one folder, ``checkpoints/step_{step}/``, with torch.distributed.checkpoint (DCP): every rank saves its
shards of the model and optimizer (``get_state_dict``: DTensor- and FSDP2-aware) and its own RNG state, and
rank 0 adds ``run.json`` (format, step, config, metrics). The folder is written as ``step_{step}.tmp`` and
renamed by rank 0 once every rank is done, so a run killed mid-write leaves the previous checkpoint whole.
Every rank must see ``--out`` (one node, or a shared file system).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recompute.core.errors import ConfigError
from recompute.train.config import RESUME_MUST_MATCH, TrainConfig

__all__ = ["checkpoints", "load_latest", "save_checkpoint"]

FORMAT = "recompute.train/1"
SHARDED_FORMAT = "recompute.train.dcp/1"
RUN_FILE = "run.json"
"""What rank 0 writes into a sharded checkpoint's folder besides DCP's files."""


def checkpoints(out: Path) -> list[Path]:
    """Checkpoints in ``out`` (``step_*.pt`` files and ``step_*`` folders), oldest first."""
    found = []
    for p in (out / "checkpoints").glob("step_*"):
        name = re.fullmatch(r"step_(\d+)(\.pt)?", p.name)
        if name and (p.is_file() if name[2] else p.is_dir()):
            found.append((int(name[1]), p))
    return [p for _, p in sorted(found)]


def save_checkpoint(
    out: Path, step: int, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, metrics: list[Any]
) -> Path:
    """Write the checkpoint of ``step`` atomically and keep only the newest ``config.keep``.

    A one-process run writes ``checkpoints/step_{step}.pt``; a torchrun run (``config.parallel``), on every
    rank, the folder ``checkpoints/step_{step}`` (the module's docstring).
    """
    if config.parallel:
        return _save_sharded(out, step, config, model, opt, metrics)
    folder = out / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "step": step,
        "config": config.to_dict(),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "metrics": metrics,
    }
    path = folder / f"step_{step:07d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous checkpoint intact
    _prune(out, config.keep)
    return path


def _prune(out: Path, keep: int) -> None:
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def load_latest(out: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list[Any]]:
    """Restore the newest checkpoint in ``out`` into ``model`` and ``opt``; return (step, metrics so far).

    Raises:
        ConfigError: no checkpoint, an unreadable one, or one written by a different configuration.
    """
    found = checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start")
    path = found[-1]
    if path.is_dir():
        return _load_sharded(path, config, model, opt)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("not a recompute training checkpoint")
    except Exception as e:  # torch.load raises many kinds for a truncated or foreign file
        raise _unreadable(path, e) from e
    _check_same_run(state["config"], config, path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"]), list(state["metrics"])


def _check_same_run(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    now, default = config.to_dict(), TrainConfig().to_dict()  # the defaults stand in for fields added since
    was = {k: saved.get(k, default[k]) for k in RESUME_MUST_MATCH}
    differ = [k for k in RESUME_MUST_MATCH if was[k] != now[k]]
    if differ:
        pairs = ", ".join(f"{k}: {was[k]!r} -> {now[k]!r}" for k in differ)
        raise ConfigError(f"{str(path)!r} was written by a different run ({pairs}); resume with the same options")


# --- sharded (torchrun) checkpoints -------------------------------------------------------------------------


def _save_sharded(
    out: Path, step: int, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, metrics: list[Any]
) -> Path:
    """Every rank: its shards into ``step_{step}.tmp``; then rank 0 renames the folder and prunes old ones."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = out / "checkpoints"
    path, tmp = folder / f"step_{step:07d}", folder / f"step_{step:07d}.tmp"
    main = dist.get_rank() == 0
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
    dist.barrier()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state, "rng": _rng_state()}, checkpoint_id=tmp)
    if main:
        run = {"format": SHARDED_FORMAT, "step": step, "config": config.to_dict(), "metrics": metrics}
        (tmp / RUN_FILE).write_text(json.dumps(run))
    dist.barrier()  # every rank's shards are in tmp
    if main:
        if path.exists():  # this step's checkpoint from an earlier attempt of the run: the new one replaces it
            shutil.rmtree(path)
        os.replace(tmp, path)
        _prune(out, config.keep)
    dist.barrier()  # no rank goes on (or is killed) before the folder is in place
    return path


def _load_sharded(
    path: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[int, list[Any]]:
    """Every rank: the run record, the config check, then its shards and RNG state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        run = json.loads((path / RUN_FILE).read_text())
        if not isinstance(run, dict) or run.get("format") != SHARDED_FORMAT:
            raise ValueError("not a recompute training checkpoint")
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e
    _check_same_run(run["config"], config, path)
    model_state, optim_state = get_state_dict(model, opt)  # the layout to load into (optimizer state included)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "rng": _rng_state()}
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP raises CheckpointException (on every rank) for missing or damaged shards
        raise _unreadable(path, e) from e
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _set_rng_state(state["rng"])
    return int(run["step"]), list(run["metrics"])


def _rng_key() -> str:
    import torch.distributed as dist

    return f"rank{dist.get_rank()}"


def _rng_state() -> dict[str, dict[str, torch.Tensor]]:
    """This rank's RNG state under a key of its own (each rank draws its own dropout masks)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return {_rng_key(): state}


def _set_rng_state(saved: dict[str, dict[str, torch.Tensor]]) -> None:
    state = saved[_rng_key()]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _unreadable(path: Path, e: Exception) -> ConfigError:
    return ConfigError(
        f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}); "
        "delete it to resume from an older one, or run without --resume"
    )

"""Training checkpoints: written atomically, read back exactly, refused loudly when unusable.

A checkpoint holds the model and optimizer state, the step, the RNG state (so dropout continues as if the
run had not stopped), the config (a resumed run must match it) and the metrics so far.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recompute.errors import ConfigError
from recompute.train.config import RESUME_MUST_MATCH, TrainConfig

__all__ = ["checkpoints", "load_latest", "save_checkpoint"]

FORMAT = "recompute.train/1"


def checkpoints(out: Path) -> list[Path]:
    """Checkpoint files in ``out``, oldest first."""
    return sorted((out / "checkpoints").glob("step_*.pt"))


def save_checkpoint(
    out: Path, step: int, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, metrics: list[Any]
) -> Path:
    """Write ``checkpoints/step_{step}.pt`` atomically and keep only the newest ``config.keep``."""
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
    for old in checkpoints(out)[: -config.keep]:
        old.unlink()
    return path


def load_latest(out: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list[Any]]:
    """Restore the newest checkpoint in ``out`` into ``model`` and ``opt``; return (step, metrics so far).

    Raises:
        ConfigError: no checkpoint, an unreadable one, or one written by a different configuration.
    """
    found = checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start")
    path = found[-1]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("not a recompute training checkpoint")
    except Exception as e:  # torch.load raises many kinds for a truncated or foreign file
        raise ConfigError(
            f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "delete it to resume from an older one, or run without --resume"
        ) from e
    _check_same_run(state["config"], config, path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"]), list(state["metrics"])


def _check_same_run(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    now = config.to_dict()
    differ = [k for k in RESUME_MUST_MATCH if saved.get(k) != now[k]]
    if differ:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in differ)
        raise ConfigError(f"{str(path)!r} was written by a different run ({pairs}); resume with the same options")

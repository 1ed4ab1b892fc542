"""Training checkpoints: written atomically, verified tensor by tensor, passed over or refused when damaged.

A checkpoint holds the model and optimizer state, the step, the RNG state (so dropout continues as if the
run had not stopped), the config and the model's source (``loop.source_id``: a config.json's content hash; a
resumed run must match both), the metrics so far and a CRC-32 of every
tensor (Note: [checksums] ``torch.load`` does not check the CRC-32s in the zip that ``torch.save`` writes (a bit flipped
in a weight's bytes in the file loads silently: ``tests/test_train.py`` does it), and DCP stores none. So a
checkpoint stores the CRC-32 of each tensor's bytes as saved (model, optimizer, RNG; a rank's local shards under
DCP), and ``--resume`` computes them again from the tensors it loaded before it trains on them. A checkpoint
that is unreadable or fails the check is passed over for the newest older one that verifies
(``Resumed.passed_over`` says which and why); when none does, ``--resume`` stops with one line. CRC-32, not
SHA-256: it guards against damage (it catches every error burst of up to 32 bits), not against an adversary,
and is about twice as fast (``zlib.crc32`` against ``hashlib.sha256`` over a 256 MiB tensor on the 2-core
development machine: 3.2 against 1.4 GB/s).
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from recompute.core.errors import ConfigError
from recompute.train.config import RESUME_MUST_MATCH, TrainConfig
from recompute.train.run_files import CHECKPOINTS, atomic_write, checkpoints, fsync_dir

__all__ = ["Resumed", "checkpoints", "checksums", "load_latest", "metrics_crc32", "save_checkpoint"]

FORMAT = "recompute.train/2"
SHARDED_FORMAT = "recompute.train.dcp/2"
UNCHECKED = ("recompute.train/1", "recompute.train.dcp/1")
"""Formats written before checksums: still resumed from, unverified."""
RUN_FILE = "run.json"
"""What rank 0 writes into a sharded checkpoint's folder besides DCP's files."""
TENSORS = ("model", "optimizer", "rng", "cuda_rng")
"""The entries of a one-file checkpoint whose tensors have checksums."""


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from."""

    step: int
    metrics: list[dict[str, Any]]
    path: Path
    passed_over: list[str]
    """One line per newer checkpoint that was unreadable or failed its checksums, newest first."""


class _Damaged(Exception):
    """A checkpoint that cannot be used as it is; the message says why, in a few words."""


def checksums(tree: Any) -> dict[str, str]:
    """The CRC-32 of every tensor in nested dicts and lists, by dotted path (of a DTensor, this rank's shard)."""
    return {name: _crc32(t) for name, t in _tensors(tree, "")}


def _tensors(tree: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(tree, Tensor):
        yield prefix, tree
    elif isinstance(tree, dict | list | tuple):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for key, value in items:
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def _crc32(t: Tensor) -> str:
    local = t.to_local() if isinstance(t, DTensor) else t
    data = local.detach().contiguous().cpu().reshape(-1).view(torch.uint8)  # the bytes, whatever the dtype
    return f"{zlib.crc32(data.numpy().data):08x}"


def metrics_crc32(metrics: list[Any]) -> str:
    """The CRC-32 of a checkpoint's metrics (their JSON, keys sorted): a flipped byte in a stored loss is found."""
    return f"{zlib.crc32(json.dumps(metrics, sort_keys=True).encode()):08x}"


def _metrics_mismatch(record: dict[str, Any]) -> str | None:
    """Why the metrics stored with a checkpoint do not match their checksum; ``None`` when they do (or when it
    was written before metrics had one)."""
    saved = record.get("metrics_crc32")
    if saved is None:
        return None
    try:
        now = metrics_crc32(record["metrics"])
    except (KeyError, TypeError, ValueError):
        now = None
    return None if now == saved else "damaged: its metrics do not match their stored CRC-32"


def _mismatch(saved: dict[str, str], tree: Any, whose: str = "") -> str | None:
    """Why the tensors of ``tree`` do not match the checksums ``saved`` with them; ``None`` when they do."""
    now = checksums(tree)
    for name, crc in now.items():
        if saved.get(name) != crc:
            return f"damaged: tensor {name!r}{whose} does not match its stored CRC-32"
    missing = sorted(saved.keys() - now.keys())
    return f"damaged: tensor {missing[0]!r}{whose} is missing" if missing else None


def save_checkpoint(
    out: Path,
    step: int,
    config: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    metrics: list[Any],
    *,
    source: str = "",
) -> Path:
    """Write the checkpoint of ``step`` atomically and keep only the newest ``config.keep``.

    ``source`` says what model it is (``loop.source_id``); ``load_latest`` refuses it for another.

    A one-process run writes ``checkpoints/step_{step}.pt``; a torchrun run (``config.parallel``), on every
    rank, the folder ``checkpoints/step_{step}`` (the module's docstring).
    """
    if config.parallel:
        return _save_sharded(out, step, config, model, opt, metrics, source)
    folder = out / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    state = {"format": FORMAT, "step": step, "config": config.to_dict(), "source": source, **tensors}
    state["metrics"] = metrics
    state["checksums"] = checksums(tensors)
    state["metrics_crc32"] = metrics_crc32(metrics)
    path = folder / f"step_{step:07d}.pt"
    atomic_write(path, lambda f: torch.save(state, f))  # a run killed mid-write leaves the previous checkpoint
    _prune(out, config.keep)
    return path


def _prune(out: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and what a run killed mid-write left (``step_*.tmp``)."""
    for old in [*checkpoints(out)[:-keep], *(out / CHECKPOINTS).glob("step_*.tmp")]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def load_latest(
    out: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, *, source: str = ""
) -> Resumed:
    """Restore the newest checkpoint in ``out`` that verifies into ``model`` and ``opt``.

    ``source`` is this run's model (``loop.source_id``); a checkpoint of another is refused.

    Newer ones that are unreadable or fail their checksums are passed over (``Resumed.passed_over``).

    Raises:
        ConfigError: no checkpoint, none that verifies, or one written by a different configuration.
    """
    found = checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {str(out / CHECKPOINTS)!r}; run without --resume to start")
    passed_over: list[str] = []
    for path in reversed(found):
        try:
            step, metrics = (_load_sharded if path.is_dir() else _load_file)(path, config, model, opt, source)
        except _Damaged as e:
            passed_over.append(f"checkpoint {str(path)!r} is {e}")
            continue
        return Resumed(step, metrics, path, passed_over)
    older = "it is the only checkpoint" if len(found) == 1 else f"no older one verifies either ({len(found) - 1})"
    raise ConfigError(f"{passed_over[0]}, and {older}; start over with --overwrite instead of --resume")


def _load_file(
    path: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, source: str
) -> tuple[int, list[Any]]:
    """Check and restore a one-file checkpoint (nothing is restored unless every checksum matches)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") not in (FORMAT, *UNCHECKED):
            raise ValueError("not a recompute training checkpoint")
    except Exception as e:  # torch.load raises many kinds for a truncated or foreign file
        raise _Damaged(_unreadable(e)) from e
    _check_same_run(state["config"], config, path)
    _check_same_model(state.get("source"), source, path)
    if state["format"] == FORMAT:  # Note: [checksums]
        problem = _mismatch(state.get("checksums", {}), {k: state[k] for k in TENSORS}) or _metrics_mismatch(state)
        if problem:
            raise _Damaged(problem)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"]), list(state["metrics"])


def _check_same_run(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    now, default = config.to_dict(), TrainConfig().to_dict()  # the defaults stand in for fields added since
    if "dtype" not in saved and int(saved.get("dp", 1)) > 1:  # written when --micro-batch counted every rank
        saved = {**saved, "micro_batch": int(saved["micro_batch"]) // int(saved["dp"])}
    was = {k: saved.get(k, default[k]) for k in RESUME_MUST_MATCH}
    differ = [k for k in RESUME_MUST_MATCH if was[k] != now[k]]
    if differ:
        pairs = ", ".join(f"{k}: {was[k]!r} -> {now[k]!r}" for k in differ)
        raise ConfigError(f"{str(path)!r} was written by a different run ({pairs}); resume with the same options")


def _check_same_model(saved: str | None, source: str, path: Path) -> None:
    """Refuse a checkpoint of another model (one written before sources were recorded passes: no record)."""
    if saved and saved != source:
        raise ConfigError(
            f"{str(path)!r} was written for another model ({saved} -> {source}); resume with the model it was "
            "trained on, or start over with --overwrite"
        )


def _unreadable(e: Exception) -> str:
    return f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"


# --- sharded (torchrun) checkpoints -------------------------------------------------------------------------


def _save_sharded(
    out: Path,
    step: int,
    config: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    metrics: list[Any],
    source: str,
) -> Path:
    """Every rank: its shards and their checksums into ``step_{step}.tmp``; then rank 0 renames the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = out / CHECKPOINTS
    path, tmp = folder / f"step_{step:07d}", folder / f"step_{step:07d}.tmp"
    main = dist.get_rank() == 0
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
    dist.barrier()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "rng": _rng_state()}
    dcp.save(state, checkpoint_id=tmp)
    _write_json(tmp / _checksum_file(), checksums(state))
    if main:
        run = {"format": SHARDED_FORMAT, "step": step, "config": config.to_dict(), "source": source, "metrics": metrics}
        run["metrics_crc32"] = metrics_crc32(metrics)
        _write_json(tmp / RUN_FILE, run)
    dist.barrier()  # every rank's shards and checksums are in tmp
    if main:
        if path.exists():  # this step's checkpoint from an earlier attempt of the run: the new one replaces it
            shutil.rmtree(path)
        tmp.replace(path)
        fsync_dir(folder)
        _prune(out, config.keep)
    dist.barrier()  # no rank goes on (or is killed) before the folder is in place
    return path


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data).encode()))


def _checksum_file() -> str:
    import torch.distributed as dist

    return f"checksums_rank{dist.get_rank()}.json"


def _load_sharded(
    path: Path, config: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, source: str
) -> tuple[int, list[Any]]:
    """Every rank: the run record, the config check, its shards, their checksums, its RNG state (collective).

    The ranks agree on every verdict (``_agree``), so all of them resume from the same checkpoint. DCP loads
    into the model's and optimizer's own tensors: a checkpoint passed over leaves them part-loaded, and the
    older one that verifies then overwrites every one of them.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run, problem = _read_run(path)
    _agree(problem or _metrics_mismatch(run))
    _check_same_run(run["config"], config, path)
    _check_same_model(run.get("source"), source, path)
    model_state, optim_state = get_state_dict(model, opt)  # the layout to load into (optimizer state included)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "rng": _rng_state()}
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP raises CheckpointException (on every rank) for missing or damaged shards
        raise _Damaged(_unreadable(e)) from e
    if run["format"] == SHARDED_FORMAT:
        _agree(_shard_mismatch(path, state))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _set_rng_state(state["rng"])
    return int(run["step"]), list(run["metrics"])


def _read_run(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        run = json.loads((path / RUN_FILE).read_text())
        if not isinstance(run, dict) or run.get("format") not in (SHARDED_FORMAT, *UNCHECKED):
            raise ValueError("not a recompute training checkpoint")
    except (OSError, ValueError) as e:
        return {}, _unreadable(e)
    return run, None


def _shard_mismatch(path: Path, state: dict[str, Any]) -> str | None:
    """Why this rank's loaded shards do not match the checksums it saved with them; ``None`` when they do."""
    import torch.distributed as dist

    try:
        saved = json.loads((path / _checksum_file()).read_text())
    except (OSError, ValueError) as e:
        return _unreadable(e)
    return _mismatch(saved, state, f" (rank {dist.get_rank()}'s shard)")


def _agree(problem: str | None) -> None:
    """Raise ``_Damaged`` on every rank when any rank found a problem (the first rank's, in rank order)."""
    import torch.distributed as dist

    problems: list[str | None] = [problem]
    if dist.is_initialized():  # a one-process run meets a sharded checkpoint only to refuse its config
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise _Damaged(first)


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

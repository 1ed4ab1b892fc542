"""Plans and estimates from a model's profile: the route of ``plan`` and ``estimate`` for every model that is
not a preset (a transformers config.json, ``hf:NAME``, a factory). ``--analytic`` takes the closed form instead.

A cached profile is found without torch (its key hashes the config.json as read, the workload and the library
versions); only a missing one loads the torch floor to measure it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from recompute.cli._common import workload_from
from recompute.cli._lazy import torch_floor
from recompute.cli.progress import progress_bar
from recompute.core.errors import ConfigError
from recompute.core.files import is_path
from recompute.core.presets import PRESETS
from recompute.core.profile import Profile, cache_key, cached
from recompute.core.spec import hf_config_dict
from recompute.core.workload import Workload

__all__ = ["add_profile_args", "profile_for", "wants_profile"]


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--analytic",
        action="store_true",
        help="use the closed-form model even for a model that is not a preset (default: its measured profile)",
    )
    p.add_argument(
        "--profile", help="a `recompute profile -o` file: plan or estimate from it, at its workload (no torch needed)"
    )


def wants_profile(args: argparse.Namespace) -> bool:
    """True unless the model is a preset or ``--analytic`` asks for the closed form."""
    if args.analytic and args.profile:
        raise ConfigError("--analytic and --profile exclude each other; drop one")
    return args.profile is not None or (not args.analytic and args.model not in PRESETS)


def profile_for(args: argparse.Namespace, *, quiet: bool = False) -> tuple[Profile, Workload]:
    """The model's profile at the options' workload: from ``--profile``, the cache, or measured now.

    Raises:
        ConfigError: the profile file is of another workload, or the model cannot be profiled.
    """
    if args.profile:
        found = Profile.load(args.profile)
        return found, Workload(**found.workload)
    path = Path(args.model)
    if is_path(args.model):
        raw = hf_config_dict(path)
        positions = raw.get("max_position_embeddings") or raw.get("n_positions")
        wl = workload_from(args, _Positions(positions))
        hit = cached(cache_key({"config": raw}, wl.to_dict()))
        if hit is not None:
            return hit, wl
    trace = torch_floor("recompute.trace")
    source = trace.resolve_source(args.model)
    wl = workload_from(args, source)
    with progress_bar("profile", enabled=not quiet) as progress:
        result, _ = trace.cached_profile(source, wl, progress=progress)
    return result, wl


@dataclasses.dataclass(frozen=True)
class _Positions:
    """What ``workload_from`` needs of a model: its longest sequence."""

    max_positions: int | None

"""The store: where measured profiles, traced step work and calibrations are kept, and under what key. Torch-free.

One place says where the cache lives (``$RECOMPUTE_CACHE``, default ``~/.cache/recompute``), how a key is made
(the model's identity, the workload fields the measurement depends on, the versions of the libraries that
decide what a step saves) and how a file is written (to a temporary name, then renamed: a reader never sees
half a file). A file that cannot be read back counts as missing: it is measured again and replaced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from recompute.core.files import atomic_write

__all__ = [
    "MEASURED_WORKLOAD",
    "atomic_write",
    "config_identity",
    "library_versions",
    "load",
    "path",
    "root",
    "save",
    "spec_identity",
    "step_key",
]

T = TypeVar("T")

MEASURED_WORKLOAD = (
    *("micro_batch", "seq_len", "dtype", "attention", "device", "keep_grads", "loss", "loss_chunk"),
    *("tp", "sp"),
)
"""The workload fields a measured step depends on: one rank's step, tensor- and sequence-parallel (rank 0 on a
fake process group) or not; precision and data parallelism only change the model states, which are priced from
the parameter count (but for ``amp``, autocast's own step: ``step_key``), and the pipeline lays the step out
(``recompute.core.pricing``)."""

KEY_FORMAT = "recompute.store/5"
"""Part of every key: a change to what an entry holds changes it, so old files are not read as new (3: a
profile records each phase's gradient bytes, which pricing its states in another precision needs; 4: it
measures offload, its layers' host bytes and copies back; 5: offload's copies are not counted as kernels)."""


def root() -> Path:
    """``$RECOMPUTE_CACHE``, default ``~/.cache/recompute``."""
    return Path(os.environ.get("RECOMPUTE_CACHE") or Path.home() / ".cache" / "recompute")


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide what a step saves (from the installed metadata, no import)."""
    out = {}
    for name in ("torch", "transformers", "recompute"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def config_identity(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers config.json's identity: the file's content as read."""
    return {"config": dict(raw)}


def spec_identity(spec: Mapping[str, Any], *, hf: bool = False) -> dict[str, Any]:
    """A preset's identity: its spec (``ModelSpec.to_dict``) and whether transformers' class runs it."""
    return {"spec": dict(spec), "hf": hf}


def step_key(identity: Mapping[str, Any], workload: Mapping[str, Any]) -> str:
    """The key of a step measured for a model at a workload (``MEASURED_WORKLOAD`` of it, and whether it runs
    under autocast: ``precision`` amp is a step of its own) with these libraries."""
    wl = {k: workload[k] for k in MEASURED_WORKLOAD}
    if workload.get("precision") == "amp":
        wl["autocast"] = True  # only then: the keys of one-dtype steps stay as they were
    if workload.get("fsdp"):  # one rank of FSDP2 over dp ranks, its states and transients traced as they are
        wl.update(fsdp=True, dp=workload["dp"], precision=workload.get("precision"))
    blob = json.dumps(
        {"format": KEY_FORMAT, "model": identity, "workload": wl, "versions": library_versions()},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def path(kind: str, key: str) -> Path:
    """Where an entry lives: ``<root>/<kind>/<key>.json`` (kinds: ``profiles``, ``work``, ``calibration``)."""
    return root() / kind / f"{key}.json"


def save(kind: str, key: str, data: Mapping[str, Any]) -> Path:
    """Store ``data`` as the entry ``kind``/``key``; returns its path."""
    target = path(kind, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, json.dumps(data, indent=1) + "\n")
    return target


def load(kind: str, key: str, parse: Callable[[dict[str, Any]], T]) -> T | None:
    """The entry ``kind``/``key`` parsed, or None when missing or unreadable (it is measured again)."""
    found = path(kind, key)
    if not found.is_file():
        return None
    try:
        data = json.loads(found.read_text())
        return parse(data) if isinstance(data, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

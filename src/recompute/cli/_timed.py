"""Predicted time in the commands that show a cost: which device (``--device-profile``, ``--gpu``) and the
step work of a preset's policies (traced on fake tensors and cached; see ``recompute.core.timing``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from recompute.cli._lazy import torch_floor
from recompute.cli.progress import progress_bar
from recompute.core.analytic.memory import layer_activations
from recompute.core.hardware import datasheet_device
from recompute.core.plan import offload_seconds
from recompute.core.policy import POLICIES
from recompute.core.presets import PRESETS
from recompute.core.profile import cache_key, cached_work
from recompute.core.spec import ModelSpec
from recompute.core.timing import Device, StepWork, Timing, mixed_timing
from recompute.core.workload import Workload

__all__ = [
    "DEFAULT_GPU",
    "add_time_args",
    "offload_layer_seconds",
    "preset_works",
    "time_device",
    "timings",
    "untimed_reason",
]

DEFAULT_GPU = "h100-80gb"
"""The device times are predicted on when none is named: the datasheet row of an H100 SXM."""


def add_time_args(p: argparse.ArgumentParser, *, gpu: bool = True) -> None:
    """``--device-profile`` (and ``--gpu`` unless the command has its own) and ``--no-time``."""
    p.add_argument(
        "--device-profile",
        help="a `recompute calibrate -o` file: predict step times on that device "
        f"(default: the --gpu's datasheet row, else {DEFAULT_GPU}'s)",
    )
    if gpu:
        p.add_argument("--gpu", help=f"predict step times on this GPU's datasheet row (default: {DEFAULT_GPU})")
    p.add_argument(
        "--no-time",
        action="store_true",
        help="leave predicted times out (no fake-tensor trace of the step; FLOPs only, without torch)",
    )


def time_device(args: argparse.Namespace) -> Device:
    """The device of ``--device-profile``, else ``--gpu``'s datasheet row, else the default GPU's.

    Raises:
        ConfigError: a missing or unreadable device profile, or an unknown GPU.
    """
    if getattr(args, "device_profile", None):
        return Device.load(args.device_profile)
    return datasheet_device(getattr(args, "gpu", None) or DEFAULT_GPU)


def untimed_reason(args: argparse.Namespace, wl: Workload) -> str | None:
    """Why no time is predicted for this command, or None when one is."""
    if getattr(args, "no_time", False):
        return "--no-time"
    if wl.tp > 1:
        return "tensor parallelism (the time model prices one device's kernels, not their communication)"
    if getattr(args, "model", None) not in PRESETS:
        return "--analytic on a config.json: its times come from tracing transformers' class, so drop --analytic"
    return None


def preset_works(spec: ModelSpec, wl: Workload, *, quiet: bool = False) -> dict[str, StepWork]:
    """Each uniform policy's step work of a preset (two and three layers traced and scaled; cached): from the
    cache without torch, else traced (the torch floor loaded)."""
    one = Workload(**{**wl.to_dict(), "pp": 1, "dp": 1, "sp": False, "interleave": 1, "n_microbatches": None})
    key = cache_key({"spec": spec.to_dict(), "hf": False}, one.to_dict())
    found = {name: cached_work(key, name) for name in POLICIES}
    if all(w is not None for w in found.values()):
        return {name: w for name, w in found.items() if w is not None}
    trace = torch_floor("recompute.trace")
    with progress_bar("time model", enabled=not quiet) as progress:
        return dict(trace.cached_works(spec, one, list(POLICIES), progress=progress))


def offload_layer_seconds(spec: ModelSpec, wl: Workload, device: Device, *, quiet: bool = False) -> float | None:
    """Seconds one offloaded layer adds to a step on ``device`` (``recompute.core.plan.offload_seconds``: its
    saved bytes over the host link, less one layer's forward or backward), or None where offload is not priced:
    a CPU (its host memory is its memory), or a device without a host link."""
    if device.kind == "cpu" or not device.host_link:
        return None
    layer = preset_works(spec, wl, quiet=quiet)["none"].phase_seconds(device)
    saved = layer_activations(spec, wl).offloaded("offload")
    return offload_seconds(saved, layer["forward of layer 0"], layer["backward of layer 0"], device.host_link)


def timings(works: dict[str, StepWork], layer_policies: Sequence[Sequence[str]], device: Device) -> list[Timing]:
    """The timing of each per-layer assignment."""
    return [mixed_timing(works, layers, device) for layers in layer_policies]

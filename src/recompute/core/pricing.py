"""Pricing: which device a step is priced on, and what each part of a step costs there. Torch-free.

Every command that shows a time (estimate, plan, report, bench) chooses its device here and prices with the
functions here: a recompute policy's seconds per layer from the traced step work of the uniform policies
(``recompute.core.timing``'s roofline), an offloaded layer's exposed copy time, measured step times from a
``recompute bench`` result, and the reason when a workload gets no time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from recompute.core.errors import require
from recompute.core.hardware import datasheet_device
from recompute.core.policy import POLICIES
from recompute.core.results import read_bench
from recompute.core.timing import Device, StepWork, Timing, mixed_timing
from recompute.core.workload import Workload

__all__ = [
    "DEFAULT_GPU",
    "choose_device",
    "layer_costs",
    "measured_costs",
    "offload_layer_seconds",
    "offload_seconds",
    "timings",
    "unpriced",
    "unpriced_offload",
]

DEFAULT_GPU = "h100-80gb"
"""The device times are predicted on when none is named: the datasheet row of an H100 SXM."""


def choose_device(
    *, gpu: str | None = None, device_profile: str | Path | None = None, compiled: bool = False
) -> Device:
    """The device of a ``recompute calibrate`` file, else ``gpu``'s datasheet row, else the default GPU's;
    ``compiled``: priced as run under ``torch.compile`` or CUDA graphs (no eager host dispatch).

    Raises:
        ConfigError: a missing or unreadable device profile, or an unknown GPU.
    """
    device = Device.load(device_profile) if device_profile else datasheet_device(gpu or DEFAULT_GPU)
    return replace(device, compiled=True) if compiled else device


def unpriced(wl: Workload) -> str | None:
    """Why a workload gets no predicted time (the time model prices one device's kernels), or None."""
    if wl.tp > 1:
        return "tensor parallelism (the time model prices one device's kernels, not their communication)"
    return None


def layer_costs(works: Mapping[str, StepWork], device: Device, n_layers: int) -> tuple[dict[str, float], float]:
    """Seconds each recompute policy adds to one layer, and the step's seconds without recomputation, from
    each uniform policy's step work: (T_policy - T_none) / L."""
    missing = [p for p in POLICIES if p not in works]
    require(not missing, f"no step work for {', '.join(missing)}")
    times = {p: works[p].seconds(device, works["none"]) for p in POLICIES}
    return {p: max(0.0, (times[p] - times["none"]) / n_layers) for p in POLICIES}, times["none"]


def measured_costs(path: str | Path, model: str, n_layers: int) -> tuple[dict[str, float], float]:
    """The same from a ``recompute bench --json`` result of this model: its measured step times per policy.

    Raises:
        ConfigError: unreadable, of another model, or without every policy.
    """
    times = read_bench(path, model=model).step_times()
    missing = [p for p in POLICIES if p not in times]
    require(not missing, f"{path}: no measured step time for {', '.join(missing)}; bench every policy")
    base = times["none"]
    return {p: max(0.0, (times[p] - base) / n_layers) for p in POLICIES}, base


def offload_seconds(layer_bytes: float, forward: float, backward: float, host_link: float) -> float:
    """A layer's offload cost: its saved bytes copied out during the forward and back during the backward over
    the host link, less what one layer's forward (resp. backward) compute hides (the copies run on a side
    stream, prefetched one layer ahead)."""
    copy = layer_bytes / host_link
    return max(0.0, copy - forward) + max(0.0, copy - backward)


def offload_layer_seconds(none: StepWork, layer_bytes: float, device: Device) -> float | None:
    """Seconds one offloaded layer adds to a step on ``device`` (``offload_seconds`` against the first layer's
    forward and backward under ``none``), or None where offload is not priced: a CPU (its host memory is its
    memory), or a device without a host link."""
    if device.kind == "cpu" or not device.host_link:
        return None
    layer = none.phase_seconds(device)
    return offload_seconds(layer_bytes, layer["forward of layer 0"], layer["backward of layer 0"], device.host_link)


def unpriced_offload(device: Device | None, cost: str) -> str:
    """Why offload is not weighed: what its price (copy time) would need."""
    if device is None:
        return f"its price is copy time, and costs are {cost}; plan with --cost time"
    if device.kind == "cpu":
        return "the device is a CPU (its host memory is its memory)"
    if not device.host_link:
        return f"{device.label} has no host link bandwidth; calibrate it with `recompute calibrate -o`"
    return "no time is predicted"


def timings(works: Mapping[str, StepWork], layer_policies: Sequence[Sequence[str]], device: Device) -> list[Timing]:
    """The predicted timing of each per-layer assignment of a model of alike layers."""
    return [mixed_timing(works, layers, device) for layers in layer_policies]

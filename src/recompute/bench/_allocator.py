"""The CPU allocator's own peak over a call: what a real CPU step allocated at most, whoever allocated it.

A tracker that is a dispatch mode (MemTracker) sees the tensors that ops return. Inductor's compiled CPU code
allocates its buffers in generated Python that calls no op, so no mode sees them. Every CPU allocation goes
through c10's CPU allocator, though, and under ``torch.profiler.profile(profile_memory=True)`` that allocator
reports each allocation and free with its running total (the ``[memory]`` events of the trace, ``Total
Allocated``). ``allocator_peak`` reads that total from the exported trace: the most bytes allocated at once during
the call, above what was allocated when it began. Kernels' own scratch memory (oneDNN's, for instance) that does
not go through c10's allocator is not in it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recompute.core.errors import ConfigError

__all__ = ["AllocatorPeak", "allocator_peak"]


@dataclass(frozen=True)
class AllocatorPeak:
    """What c10's CPU allocator held during a call, in bytes above what it held when the call began."""

    peak: int
    """The most allocated at once."""
    end: int
    """Allocated when the call returned (its result, gradients it left)."""
    events: int
    """Allocations and frees reported."""


def allocator_peak(fn: Callable[[], Any]) -> AllocatorPeak:
    """Run ``fn()`` under the profiler with memory profiling on and read the CPU allocator's peak from it.

    Raises:
        ConfigError: this PyTorch's profiler reports no CPU memory events (a build without Kineto).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return _peak(trace)


def _peak(trace: Any) -> AllocatorPeak:
    """``allocator_peak`` of an exported trace (a Chrome trace: a list of events, or a dict holding them)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and _on_cpu(e.get("args", {}))), key=lambda e: e["ts"]
    )
    if not memory:
        raise ConfigError(
            f"this PyTorch's profiler ({torch.__version__}) reported no CPU memory event; the allocator's peak needs "
            "torch.profiler with Kineto (profile_memory=True)"
        )
    try:
        totals = [int(e["args"]["Total Allocated"]) for e in memory]
        start = totals[0] - int(memory[0]["args"]["Bytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"this PyTorch's profiler ({torch.__version__}) wrote memory events without 'Bytes' and 'Total "
            f"Allocated' ({e!r}); the allocator's peak needs them"
        ) from e
    return AllocatorPeak(peak=max(0, max(totals) - start), end=totals[-1] - start, events=len(memory))


def _on_cpu(args: dict[str, Any]) -> bool:
    """Whether a memory event is the CPU allocator's (Kineto's device type 0)."""
    return int(args.get("Device Type", 0)) == 0

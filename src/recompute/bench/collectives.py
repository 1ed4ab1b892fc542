"""``calibrate --collectives``: measure the process group's collectives for the time model's network.

Run in every process torchrun starts (gloo on the CPU, NCCL on GPUs; one node). For all-reduce, all-gather,
reduce-scatter and all-to-all over a sweep of sizes (nccl-tests' size: the all-reduce buffer, the whole
gathered or scattered tensor), every rank times the collective as a step runs it (the functional collectives
that DTensor's redistributions call; after a barrier, the median of several repeats) and the slowest rank's
time counts; the bus bandwidth S f(n) / t (``recompute.core.comms.bus_factor``)
is what the device profile keeps, per kind, against the size: ``recompute.core.comms.Network`` interpolates it
log-log, as nccl-tests' busbw column reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from recompute.core.comms import bus_factor
from recompute.core.errors import ConfigError
from recompute.core.progress import Progress, no_progress

__all__ = ["COLLECTIVES", "measure_collectives", "sizes"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def sizes(*, gpu: bool, quick: bool) -> tuple[int, ...]:
    """Sizes in bytes: 4 KiB to 64 MiB on a CPU (1 GiB on a GPU), every power of four (quick: of 16)."""
    top = 30 if gpu else 26
    step = 4 if quick else 2
    return tuple(1 << e for e in range(12, top + 1, step))


def _op(kind: str, nbytes: int, n: int, device: str) -> Callable[[], Any]:
    """One collective of ``nbytes`` (fp32 elements, a multiple of the group size), run as a step runs it: through
    the functional collectives DTensor's redistributions call (out of place, then waited on), on the whole group.
    On this CPU with gloo a 2 MiB all-reduce takes 2.4-2.5 ms that way and 1.2-1.25 ms as ``dist.all_reduce``
    (``python benchmarks/tp_profile.py``, two runs)."""
    count = max(n, nbytes // 4 // n * n)
    x = torch.ones(count, device=device)
    group = dist.group.WORLD
    assert group is not None  # measure_collectives checked that a process group is running
    if kind == "all_reduce":
        return lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    if kind == "all_gather":
        part = x[: count // n].clone()
        return lambda: funcol.wait_tensor(funcol.all_gather_tensor(part, 0, group))
    if kind == "reduce_scatter":
        return lambda: funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))
    if kind == "all_to_all":
        return lambda: funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
    raise ConfigError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")


def _time(fn: Callable[[], Any], device: str, *, repeats: int, warmup: int = 2) -> float:
    """The slowest rank's median seconds of ``fn`` (each repeat after a barrier)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if device == "cuda":
        slowest = slowest.cuda()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def measure_collectives(
    *, quick: bool = False, kinds: Sequence[str] = COLLECTIVES, progress: Progress = no_progress
) -> dict[str, Any]:
    """The bus bandwidth of each collective against its size on this process group (every rank calls it).

    Returns:
        ``{"collectives": {kind: [[bytes, busbw], ...]}, "ranks": n, "backend": ..., "times": {kind: [[bytes,
        seconds], ...]}}``: what ``recompute.core.comms.Network`` reads from a device profile's ``network``.

    Raises:
        ConfigError: no process group, or one rank alone (nothing to measure).
    """
    if not dist.is_initialized():
        raise ConfigError("--collectives measures a process group: run it under torchrun --nproc-per-node N")
    n = dist.get_world_size()
    if n < 2:
        raise ConfigError("--collectives needs at least 2 ranks: torchrun --nproc-per-node 2 (or more)")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    points: dict[str, list[list[float]]] = {}
    times: dict[str, list[list[float]]] = {}
    steps = [(k, s) for k in kinds for s in sizes(gpu=device == "cuda", quick=quick)]
    for kind in kinds:  # the group's first collectives set up its connections (docs/time.md, Communication)
        _time(_op(kind, steps[0][1], n, device), device, repeats=3, warmup=10)
    for i, (kind, nbytes) in enumerate(steps):
        progress(f"{kind} {nbytes} B", i, len(steps))
        fn = _op(kind, nbytes, n, device)
        seconds = _time(fn, device, repeats=3 if quick else 7)
        size = max(n, nbytes // 4 // n * n) * 4
        points.setdefault(kind, []).append([float(size), size * bus_factor(kind, n) / seconds])
        times.setdefault(kind, []).append([float(size), seconds])
    progress("done", len(steps), len(steps))
    return {"collectives": points, "ranks": n, "backend": dist.get_backend(), "times": times}

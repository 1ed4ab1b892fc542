"""How long the quick CPU calibration takes before and after issue 39's changes, side by side in one run, and
whether its rates, and the step times predicted from them, stay where they were.

Goal (issue 39): ``recompute calibrate --quick`` (and the quick calibration ``bench`` and ``plan`` make on first
use) under 30 s on a quiet machine, the time model no worse. Each calibration runs in a child process with an
empty store (``$RECOMPUTE_CACHE``: on first use the host's steps are traced too), alternating the code before
(``--before``, a git revision of this repository, exported to a temporary folder) and after (this tree), with
the load average noted around each. Its seconds: wall time around the child (interpreter start and imports
included), its CPU seconds, the child's own timing of ``import recompute.bench.calibrate`` and of
``calibrate("cpu", quick=True)``, and of its phases (compute, bandwidth, named ops, host).

Rates: for every curve the time model reads (matmul, bmm, attention, memory, math, each named op) the after
calibration's rate over the before one's at each size, the bare launch and the host's three costs per kernel
likewise. Each side's figure is its best over its runs (the highest rate, the lowest cost): the other jobs on
this shared machine only slow a timing down. The same ratios between the best of the before code's odd runs and
of its even runs are the noise floor. Steps: recompute's GPT and Llama of ``benchmarks/time_model.py`` (CPU
sizes), every policy's predicted step time and time overhead on each side's best calibration, and the same
between the before code's odd and even runs.

What changed in what is measured is the batch: 15 ms, not 30 (Note: [quick batches] in
``recompute.bench.calibrate``); the ring of operand copies is the same, made faster. Two calibrations apart in
time tell little of that here (two runs of the same code at load 3 to 6 gave rates 2x apart), so
``--paired-batch S`` times every rate of the quick plan in this process with batches of ``BEFORE_BATCH`` and of S
alternately (``Paired``), ``--rounds`` times each, the best of each kept: the ratios, the spread of the 30 ms
rates over their own rounds (the noise), and the steps above priced on the paired rates of each (with the after
run's host costs for both). It also prices ``math`` from the four named ops it stands for
(``math_from_named_ops``), a saving tried and left.

    python benchmarks/calibrate_speed.py [--runs 2] [--threads 1] [--before 0f833a7] [--paired-batch 0.015]
        [--rounds 2] [--out NAME]

Writes benchmarks/results/calibrate_speed.json (or ``--out``'s name there).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from profile_speed import export  # the before revision's src, exported the same way
from time_model import models

from recompute.bench.calibrate import Points, _bandwidth, _Bench, _compute, _named_ops, _plan, _timer
from recompute.core.policy import POLICIES
from recompute.core.progress import no_progress
from recompute.core.timing import Curve, Device, StepWork, timing
from recompute.core.workload import Workload
from recompute.trace import step_works

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
from recompute.bench import calibrate as c
imported = time.perf_counter() - start
phases = {}
def timed(name):
    f = getattr(c, name)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
    setattr(c, name, run)
for name in ("_compute", "_bandwidth", "_named_ops", "host_cost"):
    timed(name)
t = time.perf_counter()
device = c.calibrate("cpu", quick=True)
seconds = time.perf_counter() - t
device.save(sys.argv[1])
print(json.dumps({"calibrate_s": seconds, "import_s": imported, "phases_s": phases}))
"""

BEFORE_BATCH = 0.03
"""Seconds of each timed batch of the quick CPU calibration at ``--before`` (0f833a7)."""

MATH_OPS = ("exp", "gelu[tanh]", "silu", "_softmax")
"""The named ops the ``math`` class's mix is made of (``calibrate._bandwidth``: exp, tanh-GELU, SiLU, softmax)."""

STEPS = ((256, 4, "eager"), (1024, 1, "flash"))
"""(sequence, micro-batch, attention) of the steps priced on both calibrations: ``time_model.py``'s CPU ends."""


def calibrated(src: Path, out: Path, threads: int) -> dict[str, Any]:
    """One quick calibration in a child process importing ``recompute`` from ``src``, with an empty store."""
    env = {**os.environ, "PYTHONPATH": str(src), "RECOMPUTE_CACHE": str(out.with_suffix(".cache"))}
    load, cpu, start = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), str(threads)], env=env, capture_output=True, text=True, check=True
    )
    seconds, used = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    timed: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    cpu_seconds = used.ru_utime - cpu.ru_utime + used.ru_stime - cpu.ru_stime
    return {"wall_s": seconds, "cpu_s": cpu_seconds, **timed, "load_before": load, "load_after": os.getloadavg()[0]}


def timed_runs(before: str, runs: int, threads: int) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[Device]]]:
    """``runs`` quick calibrations of each side in child processes, alternating, and the devices they made."""
    folder = Path(tempfile.mkdtemp())
    sources = {"before": export(before, folder), "after": ROOT / "src"}
    found: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    devices: dict[str, list[Device]] = {"before": [], "after": []}
    for i in range(runs):
        for side, src in sources.items():
            path = folder / f"{side}-{i}.json"
            r = calibrated(src, path, threads)
            found[side].append(r)
            devices[side].append(Device.load(path))
            print(
                f"{side} {i}: {r['wall_s']:.1f} s wall ({r['cpu_s']:.1f} s CPU; import {r['import_s']:.1f} s, "
                f"calibrate {r['calibrate_s']:.1f} s: "
                + ", ".join(f"{k.strip('_')} {v:.1f}" for k, v in r["phases_s"].items())
                + f"), load {r['load_before']:.2f} -> {r['load_after']:.2f}",
                flush=True,
            )
    return found, devices


def best(devices: list[Device]) -> Device:
    """The first of ``devices`` with each rate the highest and each cost the lowest of them all (same sizes)."""
    first = devices[0]

    def curves(group: str) -> dict[str, Curve]:
        found = [getattr(d, group) for d in devices]
        return {k: Curve(tuple(max(p) for p in zip(*(c[k].points for c in found), strict=True))) for k in found[0]}

    hosts = [d.host for d in devices if d.host is not None]
    host = first.host and dataclasses.replace(
        first.host, **{k: min(getattr(h, k) for h in hosts) for k in ("kernel", "replay", "optimizer")}
    )
    overhead = min(d.overhead for d in devices)
    groups = {g: curves(g) for g in ("compute", "bandwidth", "ops")}
    return dataclasses.replace(first, **groups, overhead=overhead, host=host)


def rate_ratios(after: Device, before: Device) -> dict[str, list[float]]:
    """after / before of every rate the time model reads, at each size ``before`` measured."""
    out: dict[str, list[float]] = {}
    for group in ("compute", "bandwidth", "ops"):
        new, old = getattr(after, group), getattr(before, group)
        for key, curve in old.items():
            out[key] = [new[key](x) / r for x, r in curve.points]
    out["overhead"] = [after.overhead / before.overhead]
    if after.host is not None and before.host is not None:
        for cost in ("kernel", "replay", "optimizer"):
            out[f"host.{cost}"] = [getattr(after.host, cost) / getattr(before.host, cost)]
    return out


def worst(ratios: dict[str, list[float]]) -> tuple[str, float]:
    """The ratio farthest from 1 (in log), and its rate's name."""
    found = ((k, r) for k, rs in ratios.items() for r in rs)
    return max(found, key=lambda kr: abs(math.log(kr[1])))


def traced() -> list[tuple[dict[str, Any], dict[str, StepWork]]]:
    """Every policy's step work for ``models("cpu")`` at ``STEPS``, with what each is."""
    out = []
    for (name, spec), (s, b, attention) in itertools.product(models("cpu").items(), STEPS):
        wl = Workload(micro_batch=b, seq_len=s, dtype="fp32", attention=attention, device="cpu", keep_grads=False)
        works = step_works(spec, dataclasses.replace(wl, precision="fp32"), list(POLICIES))
        out.append(({"model": name, "seq_len": s, "micro_batch": b, "attention": attention}, works))
    return out


def predicted(devices: dict[str, Device], steps: list[tuple[dict[str, Any], dict[str, StepWork]]]) -> list[dict]:
    """Every policy's predicted step time and overhead on each device, for each of ``steps`` (``traced``)."""
    rows: list[dict[str, Any]] = []
    for what, works in steps:
        for policy in POLICIES:
            times = {side: timing(works[policy], works["none"], d) for side, d in devices.items()}
            rows.append(what | {"policy": policy} | {f"{side}_step_s": t.step for side, t in times.items()})
            rows[-1] |= {f"{side}_overhead": t.overhead for side, t in times.items()}
    return rows


def step_moves(steps: list[dict[str, Any]], new: str, old: str) -> dict[str, tuple[float, float]]:
    """The extremes over ``steps`` of the predicted step time on ``new`` over ``old``, and of the time overhead's
    move in points."""
    ratios = [r[f"{new}_step_s"] / r[f"{old}_step_s"] for r in steps]
    points = [100 * (r[f"{new}_overhead"] - r[f"{old}_overhead"]) for r in steps]
    return {"step_ratio": (min(ratios), max(ratios)), "overhead_points": (min(points), max(points))}


class Paired(_Bench):
    """A CPU bench of the quick plan that times every rate with batches of ``BEFORE_BATCH`` seconds (before) and of
    ``batch`` (after), alternately, ``rounds`` times each: it returns the best after rate, so that the
    calibration's own functions run on, and files the best before rate, and the before rate's spread over its
    rounds (the noise), under it."""

    def __init__(self, batch: float, rounds: int) -> None:
        super().__init__("cpu", _plan(False, True), no_progress)
        self.timers = {"before": _timer("cpu", BEFORE_BATCH), "after": _timer("cpu", batch)}
        self.rounds = rounds
        self.before: dict[float, float] = {}
        self.noise: dict[float, float] = {}

    def rate(self, size: float, *calls: Callable[[], Any], kernels: int = 1) -> float:
        found: dict[str, list[float]] = {"before": [], "after": []}
        for i in range(self.rounds):
            for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                self.timer = self.timers[side]
                found[side].append(super().rate(size, *calls, kernels=kernels))
        after = max(found["after"])
        self.before[after] = max(found["before"])
        self.noise[after] = found["before"][-1] / found["before"][0]
        return after


def paired(batch: float, rounds: int) -> dict[str, Any]:
    """Every rate of the quick CPU plan timed with batches of ``BEFORE_BATCH`` and of ``batch`` (``Paired``): the
    ratios (``batch``'s over ``BEFORE_BATCH``'s) and the noise per rate, and ``math`` made of ``MATH_OPS``' named
    timings (their harmonic mean: each reads and writes as many bytes) over ``math`` as timed."""
    bench = Paired(batch, rounds)
    after: Points = {**_compute(bench), **_bandwidth(bench), **_named_ops(bench)}
    ratios = {k: [r / bench.before[r] for _, r in points] for k, points in after.items()}
    noise = {k: [bench.noise[r] for _, r in points] for k, points in after.items()}
    named = [len(MATH_OPS) / sum(1 / after[k][i][1] for k in MATH_OPS) for i in range(len(after["math"]))]
    derived = [m / r for m, (_, r) in zip(named, after["math"], strict=True)]
    before = {k: [(x, bench.before[r]) for x, r in points] for k, points in after.items()}
    return {
        "batch_s": batch,
        "rounds": rounds,
        "ratios": ratios,
        "noise": noise,
        "math_from_named_ops": derived,
        "points": {"before": before, "after": after},
    }


def with_rates(device: Device, points: Points) -> Device:
    """``device`` with its compute, bandwidth and named-op curves made of ``points``."""
    groups: dict[str, dict[str, Curve]] = {"compute": {}, "bandwidth": {}, "ops": {}}
    for k, p in points.items():
        group = "bandwidth" if k in device.bandwidth else "compute" if k in device.compute else "ops"
        groups[group][k] = Curve(tuple(p))
    return dataclasses.replace(device, **groups)


def report_paired(found: dict[str, Any]) -> None:
    print(f"paired rates, batches of {found['batch_s'] * 1e3:.0f} ms / {BEFORE_BATCH * 1e3:.0f} ms, over the sizes:")
    for k, rs in found["ratios"].items():
        noise = found["noise"][k]
        print(f"  {k:28s} {min(rs):.3f} .. {max(rs):.3f}  (30 ms / 30 ms: {min(noise):.3f} .. {max(noise):.3f})")
    logs = [math.log(r) for rs in found["ratios"].values() for r in rs]
    print(
        f"median {math.exp(statistics.median(logs)):.3f}, worst {'{} {:.3f}'.format(*worst(found['ratios']))}; "
        f"math from the named ops / as timed: {', '.join(f'{r:.3f}' for r in found['math_from_named_ops'])}"
    )


MOVES = {
    "after": "best after / best before",
    "noise": "before's odd runs / its even runs",
    "paired": "paired rates, short batches / 30 ms (the after run's host costs for both)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="timed calibrations of each side, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads the calibrations measure with")
    parser.add_argument("--before", default="0f833a7", help="the revision whose quick calibration is timed as before")
    parser.add_argument("--paired-batch", type=float, help="also time every rate with batches of this many seconds")
    parser.add_argument("--rounds", type=int, default=2, help="--paired-batch: timings of each rate, per batch")
    parser.add_argument("--out", default="calibrate_speed.json", help="the results file in benchmarks/results")
    args = parser.parse_args()
    runs, devices = timed_runs(args.before, args.runs, args.threads)
    summary = {
        side: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "import_s", "calibrate_s")}
        for side, rs in runs.items()
    }
    for side, m in summary.items():
        print(f"{side}: median {m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} s CPU, calibrate {m['calibrate_s']:.1f} s")
    chosen = {side: best(ds) for side, ds in devices.items()}
    ratios = rate_ratios(chosen["after"], chosen["before"])
    before = devices["before"]
    noise = rate_ratios(best(before[1::2]), best(before[0::2])) if len(before) > 1 else {}
    name, ratio = worst(ratios)
    print(f"rates, best after / best before: worst {name} {ratio:.3f}; per rate, its extremes over the sizes:")
    for k, rs in ratios.items():
        spread = f"  (before's odd / even runs: {min(noise[k]):.3f} .. {max(noise[k]):.3f})" if noise else ""
        print(f"  {k:28s} {min(rs):.3f} .. {max(rs):.3f}{spread}")
    if noise:
        print("noise floor (before's odd runs / its even runs): worst {} {:.3f}".format(*worst(noise)))
        chosen |= {"before_even": best(before[0::2]), "before_odd": best(before[1::2])}
    works = traced()
    steps = predicted(chosen, works)
    moved = {"after": step_moves(steps, "after", "before")}
    if noise:
        moved["noise"] = step_moves(steps, "before_odd", "before_even")
    result = {
        "calibration": f"calibrate('cpu', quick=True) with {args.threads} thread(s), an empty store",
        "before_revision": args.before,
        "summary": summary,
        "worst_rate_ratio": {"rate": name, "after_over_before": ratio},
        "worst_noise_ratio": dict(zip(("rate", "before_odd_over_even"), worst(noise), strict=True)) if noise else None,
        "rate_ratios": ratios,
        "noise_ratios": noise,
        "predicted": moved,
        "steps": steps,
        "runs": runs,
        "devices": {side: [d.to_dict() for d in ds] for side, ds in devices.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python " + " ".join(sys.argv),
    }
    if args.paired_batch:
        torch.set_num_threads(args.threads)
        load = os.getloadavg()[0]
        found = paired(args.paired_batch, args.rounds) | {"load": [load, os.getloadavg()[0]]}
        report_paired(found)
        sides = {side: with_rates(devices["after"][0], p) for side, p in found["points"].items()}
        moved["paired"] = step_moves(predicted(sides, works), "after", "before")
        result["paired"] = found
    for what, m in moved.items():
        print(
            f"predicted step time, {MOVES[what]}: {m['step_ratio'][0]:.3f} .. {m['step_ratio'][1]:.3f} over "
            f"{len(steps)} (model, shape, policy); time overhead moved {m['overhead_points'][0]:+.1f} .. "
            f"{m['overhead_points'][1]:+.1f} points"
        )
    out = Path(__file__).parent / "results" / args.out
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

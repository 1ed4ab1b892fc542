"""Tensor parallelism on this CPU (gloo, 2 and 4 ranks): predicted against measured step time and time overhead.

For each rank count it calibrates the machine under torchrun (``recompute calibrate --collectives``: every
rank calibrates the kernels at once, as a step's ranks share the cores, then the collectives are measured on the
process group) unless the profile exists, then runs ``recompute bench --tp N --sp`` for each model and shape,
every policy, TP and TP + SP, the timed steps going round the policies, and compares each row's measured step
with the time model's (the fake-tensor trace of rank 0: kernels on the calibrated roofline, collectives on the
measured ones, the host's costs of a tensor-parallel step per kernel and per collective as calibrated), and with
the same prediction without those two host costs ("before"). Writes benchmarks/results/tp_time_cpu.json.

    python benchmarks/tp_time.py [--ranks 2,4] [--steps 5] [--calibrate]
    python benchmarks/tp_time.py --reprice     # the measured steps of the last run, priced by this code
    python benchmarks/tp_time.py --calibrate --warm --ranks 2 --out benchmarks/results/tp_time_cpu_warm_cold.json

``--warm`` also calibrates each rank count on warm operands (``calibrate --operands warm``, the calibration before
Note: [cold operands]) and prices the same measured steps on both. The device profiles lie beside ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recompute.bench._torchrun import predict_parallel
from recompute.cli import build_parser
from recompute.cli._common import workload_from
from recompute.core.policy import Policy
from recompute.core.pricing import choose_device
from recompute.core.spec import ModelSpec
from recompute.core.timing import Device
from recompute.core.workload import Workload

HERE = Path(__file__).parent / "results"
POLICIES = "none,core_attn,attn,mlp,attn+mlp,block"
SIZE = {"n_layers": 4, "hidden": 512, "n_heads": 8, "vocab": 8192}
"""CPU-sized GPT shapes: a small vocabulary, so that the layers are most of the step (recompute's Llama resized
keeps Llama 3.1's d_ff of 14336, too slow here)."""
CASES = {  # name: bench's workload flags
    "gpt s512 b2": ["--seq-len", "512", "--micro-batch", "2"],
    "gpt s256 b4 eager": ["--seq-len", "256", "--micro-batch", "4", "--attention", "eager"],
}
SIZE_FLAGS = ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def torchrun(n: int, args: list[str], timeout: int, *, tries: int = 1) -> str:
    """``recompute ARGS`` on ``n`` gloo ranks, its output; ``tries`` > 1: run again after a failure (once in a
    run here, a rank of ``calibrate --collectives`` aborted in gloo mid-step: the whole log is kept)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "recompute"]
    for attempt in range(1, tries + 1):
        done = subprocess.run([*cmd, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
        if not done.returncode:
            return done.stdout
        log = HERE / f"tp_time_failed_{n}_{attempt}.log"
        log.write_text(done.stderr)
        print(f"recompute {args[0]} on {n} ranks failed (attempt {attempt}; whole log: {log})", file=sys.stderr)
    raise SystemExit(f"recompute {' '.join(args)} on {n} ranks failed:\n{done.stderr[-3000:]}")


def without_parallel_host(profile: Path) -> Device:
    """The profile's device as priced before issue 25's 6b: no host cost of a tensor-parallel step."""
    device = choose_device(device_profile=profile)
    assert device.host is not None
    return dataclasses.replace(device, host=dataclasses.replace(device.host, parallel=0.0, collective=0.0))


def rows_of(measured: dict[tuple[str, str], float], wl: Workload, profile: Path) -> list[dict[str, Any]]:
    """Each (mode, policy)'s measured step against the time model's prediction on ``profile`` (rank 0's trace, as
    ``bench`` predicts it), against the same prediction without the tensor-parallel host costs ("before"), and,
    where a warm calibration lies beside the profile (``--warm``), against the prediction on it ("warm")."""
    spec, pols = ModelSpec.from_name("gpt2", **SIZE), [Policy.parse(p) for p in POLICIES.split(",")]
    now = predict_parallel(spec, wl, pols, choose_device(device_profile=profile), modes=(False, True))
    then = predict_parallel(spec, wl, pols, without_parallel_host(profile), modes=(False, True))
    warm_profile = warm_of(profile)
    warm = None
    if warm_profile.exists():
        warm = predict_parallel(spec, wl, pols, choose_device(device_profile=warm_profile), modes=(False, True))
    out = []
    for (mode, policy), step in measured.items():
        sp, ref = mode == "TP+SP", measured[mode, "none"]
        predicted, before = now[sp, policy].step, then[sp, policy].step
        extra = {}
        if warm is not None:
            w = warm[sp, policy].step
            extra = {"warm_s": w, "warm_step_error": w / step - 1, "warm_overhead": w / warm[sp, "none"].step - 1}
        out.append(
            {
                "mode": mode,
                "policy": policy,
                "measured_s": step,
                "predicted_s": predicted,
                "step_error": predicted / step - 1,
                "measured_overhead": step / ref - 1,
                "predicted_overhead": predicted / now[sp, "none"].step - 1,
                "before_s": before,
                "before_step_error": before / step - 1,
                "before_overhead": before / then[sp, "none"].step - 1,
                **extra,
            }
        )
    return out


def profile_of(out: Path, ranks: int) -> Path:
    """The device profile of ``ranks`` beside the results file ``out``: tp_time_cpu_device_2.json by default."""
    return out.with_name(f"{out.stem}_device_{ranks}.json")


def warm_of(profile: Path) -> Path:
    """The calibration on warm operands (``calibrate --operands warm``) beside a profile."""
    return profile.with_name(f"{profile.stem}_warm.json")


def workload_of(flags: list[str]) -> Workload:
    """The workload ``recompute bench FLAGS`` runs."""
    return workload_from(build_parser("bench").parse_args(flags), ModelSpec.from_name("gpt2", **SIZE))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for run in runs for r in run["rows"]]
    by_policy = {}
    for policy in POLICIES.split(",")[1:]:
        errs = [abs(r["predicted_overhead"] - r["measured_overhead"]) * 100 for r in rows if r["policy"] == policy]
        by_policy[policy] = {"median_points": statistics.median(errs), "max_points": max(errs)}
    out: dict[str, Any] = {"by_policy": by_policy}
    for key, step, over in (
        ("", "step_error", "predicted_overhead"),
        ("before_", "before_step_error", "before_overhead"),
        ("warm_", "warm_step_error", "warm_overhead"),
    ):
        if any(step not in r for r in rows):
            continue
        steps = [abs(r[step]) * 100 for r in rows]
        overheads = [abs(r[over] - r["measured_overhead"]) * 100 for r in rows if r["policy"] != "none"]
        out[f"{key}median_step_error_percent"] = statistics.median(steps)
        out[f"{key}median_overhead_error_points"] = statistics.median(overheads)
    return out


def render(runs: list[dict[str, Any]], total: dict[str, Any]) -> str:
    lines = ["| ranks | case | mode | step measured (s) | predicted | before | " + " | ".join(POLICIES.split(",")[1:])]
    lines[0] += " |"
    lines.append("| --- " * (6 + len(POLICIES.split(",")) - 1) + "|")
    for run in runs:
        for mode in ("TP", "TP+SP"):
            rows = {r["policy"]: r for r in run["rows"] if r["mode"] == mode}
            none = rows["none"]
            cells = [
                f"{100 * rows[p]['measured_overhead']:+.1f} / {100 * rows[p]['predicted_overhead']:+.1f}"
                for p in POLICIES.split(",")[1:]
            ]
            lines.append(
                f"| {run['ranks']} | {run['case']} | {mode} | {none['measured_s']:.3f} | {none['predicted_s']:.3f} "
                f"({100 * none['step_error']:+.0f} %) | {none['before_s']:.3f} "
                f"({100 * none['before_step_error']:+.0f} %) | " + " | ".join(cells) + " |"
            )
    lines += ["", "| policy | median \\|error\\| (points) | max |", "| --- | --- | --- |"]
    for policy, e in total["by_policy"].items():
        lines.append(f"| {policy} | {e['median_points']:.1f} | {e['max_points']:.1f} |")
    lines.append("")
    lines.append(
        f"median |step error| {total['median_step_error_percent']:.1f} %, median |overhead error| "
        f"{total['median_overhead_error_points']:.1f} points; without the tensor-parallel host costs "
        f"{total['before_median_step_error_percent']:.1f} % and "
        f"{total['before_median_overhead_error_points']:.1f} points"
    )
    if "warm_median_step_error_percent" in total:
        lines.append(
            f"on the warm calibration (the same ranks' steps, calibrated with --operands warm): median |step error| "
            f"{total['warm_median_step_error_percent']:.1f} %, median |overhead error| "
            f"{total['warm_median_overhead_error_points']:.1f} points; by case, step error warm: "
            + ", ".join(
                f"{run['ranks']} ranks {run['case']} {r['mode']} {100 * r['warm_step_error']:+.0f} %"
                for run in runs
                for r in run["rows"]
                if r["policy"] == "none" and "warm_step_error" in r
            )
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds per bench (one step per policy each)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--calibrate", action="store_true", help="calibrate again even where a profile exists")
    parser.add_argument("--quick", action="store_true", help="quick calibrations (a smoke run)")
    parser.add_argument("--out", type=Path, default=HERE / "tp_time_cpu.json")
    parser.add_argument(
        "--reprice",
        action="store_true",
        help="price the steps measured in --out again with this code and the profiles beside it (no torchrun)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="also calibrate with --operands warm (beside each profile, *_warm.json) and price the steps on it",
    )
    args = parser.parse_args()
    runs = []
    start = time.perf_counter()
    if args.reprice:
        runs = json.loads(args.out.read_text())["runs"]
        for run in runs:
            measured = {(r["mode"], r["policy"]): r["measured_s"] for r in run["rows"]}
            run["rows"] = rows_of(measured, workload_of(run["flags"]), profile_of(args.out, run["ranks"]))
    for n in () if args.reprice else (int(x) for x in args.ranks.split(",")):
        profile = profile_of(args.out, n)
        for path, operands in ((profile, "cold"), (warm_of(profile), "warm")):
            if (args.calibrate or not path.exists()) and (operands == "cold" or args.warm):
                path.unlink(missing_ok=True)
                flags = ["--quick"] if args.quick else []
                flags += ["--operands", operands, "-o", str(path), "--json"]
                torchrun(n, ["calibrate", "--collectives", *flags], timeout=3600, tries=2)
                print(f"calibrated {n} ranks, {operands} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        for case in args.cases.split(","):
            flags = ["bench", "--tp", str(n), "--sp", *SIZE_FLAGS, *CASES[case], "--policies", POLICIES]
            flags += ["--steps", str(args.steps), "--json", "--device-profile", str(profile)]
            result = json.loads(torchrun(n, flags, timeout=3600))
            measured = {(r["mode"], r["policy"]): r["step_s"] for r in result["rows"]}
            rows = rows_of(measured, workload_of(flags), profile)
            runs.append({"ranks": n, "case": case, "flags": flags, "rows": rows, "notes": result["notes"]})
            print(f"{n} ranks, {case} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    total = summary(runs)
    print(render(runs, total))
    hosts = {n: Device.load(profile_of(args.out, n)).host for n in {run["ranks"] for run in runs}}
    host = {n: None if h is None else h.to_dict() for n, h in hosts.items()}
    data = {"machine": platform.platform(), "cores": os.cpu_count(), "summary": total, "host": host, "runs": runs}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

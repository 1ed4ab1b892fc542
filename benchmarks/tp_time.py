"""Tensor parallelism on this CPU (gloo, 2 and 4 ranks): predicted against measured step time and time overhead.

For each rank count it calibrates the machine under torchrun (``recompute calibrate --collectives``: every
rank calibrates the kernels at once, as a step's ranks share the cores, then the collectives are measured on the
process group) unless the profile exists, then runs ``recompute bench --tp N --sp`` for each model and shape,
every policy, TP and TP + SP, the timed steps going round the policies, and compares each row's measured step
with the time model's (the fake-tensor trace of rank 0: kernels on the calibrated roofline, collectives on the
measured ones). Writes benchmarks/results/tp_time_cpu.json.

    python benchmarks/tp_time.py [--ranks 2,4] [--steps 5] [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent / "results"
POLICIES = "none,core_attn,attn,mlp,attn+mlp,block"
CASES = {  # name: bench flags (CPU-sized: a small vocabulary, so that the layers are most of the step; recompute's
    # Llama resized keeps Llama 3.1's d_ff of 14336, too slow here)
    "gpt s512 b2": ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192", "--seq-len", "512",
                    "--micro-batch", "2"],
    "gpt s256 b4 eager": ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192", "--seq-len", "256",
                          "--micro-batch", "4", "--attention", "eager"],
}  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def torchrun(n: int, args: list[str], timeout: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "recompute"]
    done = subprocess.run([*cmd, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"recompute {' '.join(args)} on {n} ranks failed:\n{done.stderr[-3000:]}")
    return done.stdout


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    base = {r["mode"]: r for r in result["rows"] if r["policy"] == "none"}
    out = []
    for r in result["rows"]:
        ref = base[r["mode"]]
        out.append(
            {
                "mode": r["mode"],
                "policy": r["policy"],
                "measured_s": r["step_s"],
                "predicted_s": r["predicted_s"],
                "step_error": r["predicted_s"] / r["step_s"] - 1,
                "measured_overhead": r["step_s"] / ref["step_s"] - 1,
                "predicted_overhead": r["predicted_s"] / ref["predicted_s"] - 1,
            }
        )
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for run in runs for r in run["rows"]]
    by_policy = {}
    for policy in POLICIES.split(",")[1:]:
        errs = [abs(r["predicted_overhead"] - r["measured_overhead"]) * 100 for r in rows if r["policy"] == policy]
        by_policy[policy] = {"median_points": statistics.median(errs), "max_points": max(errs)}
    steps = [abs(r["step_error"]) * 100 for r in rows]
    overheads = [abs(r["predicted_overhead"] - r["measured_overhead"]) * 100 for r in rows if r["policy"] != "none"]
    return {
        "median_step_error_percent": statistics.median(steps),
        "median_overhead_error_points": statistics.median(overheads),
        "by_policy": by_policy,
    }


def render(runs: list[dict[str, Any]], total: dict[str, Any]) -> str:
    lines = ["| ranks | case | mode | step measured (s) | predicted | " + " | ".join(POLICIES.split(",")[1:]) + " |"]
    lines.append("| --- " * (5 + len(POLICIES.split(",")) - 1) + "|")
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
                f"({100 * none['step_error']:+.0f} %) | " + " | ".join(cells) + " |"
            )
    lines += ["", "| policy | median \\|error\\| (points) | max |", "| --- | --- | --- |"]
    for policy, e in total["by_policy"].items():
        lines.append(f"| {policy} | {e['median_points']:.1f} | {e['max_points']:.1f} |")
    lines.append("")
    lines.append(
        f"median |step error| {total['median_step_error_percent']:.1f} %, median |overhead error| "
        f"{total['median_overhead_error_points']:.1f} points"
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
    args = parser.parse_args()
    runs = []
    start = time.perf_counter()
    for n in (int(x) for x in args.ranks.split(",")):
        profile = HERE / f"tp_time_cpu_device_{n}.json"
        if args.calibrate or not profile.exists():
            profile.unlink(missing_ok=True)
            flags = ["--quick"] if args.quick else []
            torchrun(n, ["calibrate", "--collectives", *flags, "-o", str(profile), "--json"], timeout=3600)
            print(f"calibrated {n} ranks ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        for case in args.cases.split(","):
            flags = ["bench", "--tp", str(n), "--sp", *CASES[case], "--policies", POLICIES]
            flags += ["--steps", str(args.steps), "--json", "--device-profile", str(profile)]
            result = json.loads(torchrun(n, flags, timeout=3600))
            runs.append({"ranks": n, "case": case, "flags": flags, "rows": rows_of(result), "notes": result["notes"]})
            print(f"{n} ranks, {case} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    total = summary(runs)
    print(render(runs, total))
    args.out.write_text(
        json.dumps({"machine": platform.platform(), "cores": os.cpu_count(), "summary": total, "runs": runs}, indent=1)
        + "\n"
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

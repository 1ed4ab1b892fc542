"""The time model against measured steps: calibrate this device, then sweep recompute's GPT and Llama.

For every model (recompute's GPT with dropout and its Llama), attention (eager, SDPA) and shape (s from 256 to
2048, b from 1 to 8), it predicts each policy's step time and time overhead from the fake-tensor trace of the
step priced on the calibrated device (``recompute.core.timing``), and measures real steps with
``recompute.bench``: every policy one step per round (``rounds``: each round builds every policy afresh), so a
policy's measured overhead is the median over rounds of its step time over the same round's ``none`` step (paired
ratios; see the notes of benchmarks/plan_vs_uniform.py on this shared machine's noise). Writes per-configuration
rows and per-policy errors to benchmarks/results/time_model_<device>.json and the device profile beside it.

    python benchmarks/time_model.py [--device cpu|cuda] [--rounds 7] [--quick]

Goal (issue 14): |measured - predicted overhead| <= 3 points for every policy and predicted step time within
15 %, medians over the sweep. On the CPU the run uses one torch thread and glibc's reuse settings (the note
[the CPU allocator] of plan_vs_uniform.py), like the calibration.

Every configuration is priced twice from the same measurements (issue 25, item 4): with the host's time per
kernel calibrated on real eager steps (``HostCost``; the ``predicted_*`` figures) and with a bare launch per
kernel instead, as before host dispatch was priced (the ``bare_*`` figures). ``--shapes 256x4,1024x1`` runs a
subset of the shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from plan_vs_uniform import paired_overhead, use_allocator

from recompute import ModelSpec, Workload
from recompute.bench import bench
from recompute.bench.calibrate import calibrate
from recompute.core.policy import POLICIES
from recompute.core.table import render_table
from recompute.core.timing import Device, timing
from recompute.trace import step_works

RESULTS = Path(__file__).parent / "results"

SHAPES = {
    "cpu": ((256, 4), (512, 2), (1024, 1), (2048, 1)),
    "cuda": ((256, 8), (512, 4), (1024, 2), (2048, 1), (2048, 8)),
}
"""(sequence, micro-batch) per device: s from 256 to 2048, b from 1 to 8."""


def models(device: str) -> dict[str, ModelSpec]:
    """recompute's GPT (dropout 0.1, tanh GELU) and Llama (GQA, SwiGLU, RMSNorm), sized for the device."""
    if device == "cpu":
        gpt = ModelSpec.from_name("gpt2", hidden=256, n_layers=4, n_heads=4, vocab=4096, max_positions=2048)
        llama = ModelSpec.from_name(  # Llama 3.1's MLP ratio (14336 / 4096 = 3.5)
            "llama3.1-8b", hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=896, vocab=4096, max_positions=2048
        )
    else:
        gpt = ModelSpec.from_name("gpt2", max_positions=2048)
        llama = ModelSpec.from_name(
            "llama3.1-8b", hidden=1024, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=3584, vocab=32000, max_positions=2048
        )
    return {"gpt": gpt, "llama": llama}


def run_config(spec: ModelSpec, wl: Workload, device: Device, rounds: int) -> dict[str, Any]:
    """Predicted and measured step time and overhead of every policy at one configuration."""
    t0 = time.perf_counter()
    works = step_works(spec, wl, list(POLICIES))
    traced = time.perf_counter() - t0
    predicted = {p: timing(works[p], works["none"], device) for p in POLICIES}
    bare_device = dataclasses.replace(device, host=None)
    bare = {p: timing(works[p], works["none"], bare_device) for p in POLICIES}
    result = bench(spec, wl, list(POLICIES), steps=rounds, warmup=2, rounds=rounds)
    rows = {r.policy: r for r in result.rows}
    base = rows["none"].step_times
    measured_step = statistics.median(base)
    out: dict[str, Any] = {
        "model": spec.name,
        "seq_len": wl.seq_len,
        "micro_batch": wl.micro_batch,
        "attention": wl.attention,
        "trace_seconds": traced,
        "measured_step_s": measured_step,
        "predicted_step_s": predicted["none"].step,
        "step_error": predicted["none"].step / measured_step - 1,
        "bare_step_s": bare["none"].step,
        "bare_step_error": bare["none"].step / measured_step - 1,
        "kernels": works["none"].kernels(),
        "policies": {},
    }
    for p in POLICIES:
        meas = paired_overhead(rows[p].step_times, base)
        out["policies"][p] = {
            "measured_overhead": meas,
            "predicted_overhead": predicted[p].overhead,
            "flop_overhead": rows[p].predicted_overhead,
            "error_points": 100 * (predicted[p].overhead - meas),
            "bare_overhead": bare[p].overhead,
            "bare_error_points": 100 * (bare[p].overhead - meas),
            "flop_error_points": 100 * (rows[p].predicted_overhead - meas),
            "replayed_kernels": sum(works[p].replayed(works["none"]).values()),
            "step_times": list(rows[p].step_times),
        }
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: median |error| of the time model and of FLOPs; the step time's median |error|."""
    per: dict[str, Any] = {}
    for p in POLICIES:
        if p == "none":
            continue
        errors = [abs(r["policies"][p]["error_points"]) for r in rows]
        bare = [abs(r["policies"][p]["bare_error_points"]) for r in rows]
        flop = [abs(r["policies"][p]["flop_error_points"]) for r in rows]
        per[p] = {
            "median_abs_error_points": statistics.median(errors),
            "max_abs_error_points": max(errors),
            "median_abs_bare_error_points": statistics.median(bare),
            "max_abs_bare_error_points": max(bare),
            "median_abs_flop_error_points": statistics.median(flop),
        }
    step = statistics.median(abs(r["step_error"]) for r in rows)
    return {
        "policies": per,
        "median_abs_step_error": step,
        "median_abs_bare_step_error": statistics.median(abs(r["bare_step_error"]) for r in rows),
        "goal_overhead_3_points": all(v["median_abs_error_points"] <= 3 for v in per.values()),
        "goal_step_15_percent": step <= 0.15,
    }


def write(
    out: Path, args: argparse.Namespace, device: Device, dtype: str, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The results file with the rows so far and their summary; returns the summary."""
    summ = summary(rows)
    record = {
        "benchmark": "time_model",
        "command": "python " + " ".join(sys.argv),
        "device": device.label,
        "device_source": device.source,
        "host_dispatch": device.host_note(),
        "host": platform.node(),
        "torch": torch.__version__,
        "dtype": dtype,
        "rounds": args.rounds,
        "summary": summ,
        "configs": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return summ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds: one step of each policy per round")
    parser.add_argument("--quick", action="store_true", help="a quick calibration and two shapes (a smoke run)")
    parser.add_argument("--dtype", default=None, help="default: fp32 on the CPU, bf16 on a GPU")
    parser.add_argument("--device-profile", type=Path, help="a `recompute calibrate -o` file of this device")
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    parser.add_argument("--attention", default="eager,flash", help="comma-separated: eager, flash")
    parser.add_argument("--shapes", default=None, help="a subset of the shapes, SxB comma-separated (e.g. 256x4)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/time_model_<device>.json")
    args = parser.parse_args()
    if args.device == "cpu":
        use_allocator("reuse")
        torch.set_num_threads(1)
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    out = args.out or RESULTS / f"time_model_{'gpu' if args.device == 'cuda' else 'cpu'}.json"
    if args.device_profile:
        device = Device.load(args.device_profile)
    else:
        print(f"calibrating {args.device}", flush=True)
        device = calibrate(args.device, quick=args.quick)
    device.save(out.with_name(out.stem + "_device.json"))
    shapes = SHAPES[args.device][:1] if args.quick else SHAPES[args.device]
    if args.shapes:
        shapes = tuple((int(shape.split("x")[0]), int(shape.split("x")[1])) for shape in args.shapes.split(","))
    rows = []
    chosen = args.models.split(",")
    for name, spec in ((k, v) for k, v in models(args.device).items() if k in chosen):
        for attention in args.attention.split(","):
            for s, b in shapes:
                wl = Workload(
                    micro_batch=b, seq_len=s, dtype=dtype, attention=attention, device=args.device, keep_grads=False
                )
                if args.device == "cpu":
                    wl = dataclasses.replace(wl, precision="fp32")
                row = run_config(spec, wl, device, args.rounds)
                rows.append(row)
                cells = " ".join(
                    f"{p}:{100 * v['measured_overhead']:+.1f}/{100 * v['predicted_overhead']:+.1f}"
                    f"/{100 * v['bare_overhead']:+.1f}"
                    for p, v in row["policies"].items()
                    if p != "none"
                )
                print(
                    f"{name} {attention} s={s} b={b}: step {row['measured_step_s'] * 1e3:.1f} ms measured, "
                    f"{row['predicted_step_s'] * 1e3:.1f} predicted ({row['step_error']:+.1%}), "
                    f"{row['bare_step_s'] * 1e3:.1f} with a bare launch ({row['bare_step_error']:+.1%}); "
                    f"overhead measured/predicted/bare launch % {cells}",
                    flush=True,
                )
                write(out, args, device, dtype, rows)  # after every configuration: a cut-off run keeps its rows
    summ = write(out, args, device, dtype, rows)
    table = [
        [
            p,
            f"{v['median_abs_error_points']:.1f}",
            f"{v['max_abs_error_points']:.1f}",
            f"{v['median_abs_bare_error_points']:.1f}",
            f"{v['median_abs_flop_error_points']:.1f}",
        ]
        for p, v in summ["policies"].items()
    ]
    heads = ["policy", "median |error| (pts)", "max", "bare launch's median |error|", "FLOP model's median |error|"]
    print(render_table(heads, table))
    print(
        f"median |step time error|: {summ['median_abs_step_error']:.1%} "
        f"(bare launch: {summ['median_abs_bare_step_error']:.1%})"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Warm against cold operands: the same measured CPU steps priced on two calibrations of this machine.

``recompute calibrate`` times each op on a CPU with its operands rotated through copies twice the last-level cache
in size, so that every call finds them out of the cache, as an op of a training step does (Note: [cold operands]
in ``recompute.bench.calibrate``). This calibrates the CPU twice (``--quick``, one thread, glibc's reuse
settings), with the operands rotated and with the same operands call after call (``calibrate(cold=False)``, as
before), then measures ``none`` and ``block`` steps of recompute's GPT and Llama (the CPU sizes of
``time_model.py``, and the GPT shape of ``tp_time.py``: h 512, 4 layers) with ``recompute.bench`` and prices
each on both. Writes benchmarks/results/cold_operands_cpu.json.

    python benchmarks/cold_operands.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any

import torch
from plan_vs_uniform import paired_overhead, use_allocator
from time_model import models
from tp_time import SIZE

from recompute import ModelSpec, Workload
from recompute.bench import bench
from recompute.bench.calibrate import calibrate
from recompute.core.table import render_table
from recompute.core.timing import timing
from recompute.trace import step_works

OUT = Path(__file__).parent / "results" / "cold_operands_cpu.json"
POLICIES = ["none", "block"]


def configs() -> list[tuple[str, ModelSpec, Workload]]:
    """(label, model, workload): time_model's CPU GPT and Llama at two shapes, eager and SDPA, and tp_time's GPT."""
    out = []
    for name, spec in models("cpu").items():
        for attention in ("eager", "flash"):
            for s, b in ((256, 4), (1024, 1)):
                out.append((f"{name} {attention} s{s} b{b}", spec, _workload(b, s, attention)))
    wide = ModelSpec.from_name("gpt2", **SIZE)
    out.append(("gpt h512 flash s512 b2", wide, _workload(2, 512, "flash")))
    return out


def _workload(b: int, s: int, attention: str) -> Workload:
    return Workload(
        micro_batch=b, seq_len=s, dtype="fp32", precision="fp32", attention=attention, device="cpu", keep_grads=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed steps of each policy, one per round")
    args = parser.parse_args()
    use_allocator("reuse")
    torch.set_num_threads(1)
    devices = {kind: calibrate("cpu", quick=True, cold=kind == "cold") for kind in ("warm", "cold")}
    rows: list[dict[str, Any]] = []
    for label, spec, wl in configs():
        works = step_works(spec, wl, POLICIES)
        result = bench(spec, wl, POLICIES, steps=args.rounds, warmup=1, rounds=args.rounds)
        measured = {r.policy: r.step_times for r in result.rows}
        step = statistics.median(measured["none"])
        row: dict[str, Any] = {
            "config": label,
            "measured_step_s": step,
            "measured_overhead": paired_overhead(measured["block"], measured["none"]),
        }
        for kind, device in devices.items():
            base = timing(works["none"], works["none"], device).step
            row[f"{kind}_step_s"] = base
            row[f"{kind}_step_error"] = base / step - 1
            row[f"{kind}_overhead"] = timing(works["block"], works["none"], device).overhead
        rows.append(row)
        print(
            f"{label}: step {step * 1e3:.0f} ms measured, {row['warm_step_s'] * 1e3:.0f} warm "
            f"({row['warm_step_error']:+.1%}), {row['cold_step_s'] * 1e3:.0f} cold ({row['cold_step_error']:+.1%})",
            flush=True,
        )
    summary = {}
    for kind in devices:
        summary[f"median_abs_{kind}_step_error"] = statistics.median(abs(r[f"{kind}_step_error"]) for r in rows)
        errors = (abs(r[f"{kind}_overhead"] - r["measured_overhead"]) for r in rows)
        summary[f"median_abs_{kind}_overhead_error"] = statistics.median(errors)
    table = [
        [
            r["config"],
            f"{r['measured_step_s'] * 1e3:.0f}",
            f"{r['warm_step_s'] * 1e3:.0f} ({r['warm_step_error']:+.1%})",
            f"{r['cold_step_s'] * 1e3:.0f} ({r['cold_step_error']:+.1%})",
            f"{100 * r['measured_overhead']:+.1f} / {100 * r['warm_overhead']:+.1f} / {100 * r['cold_overhead']:+.1f}",
        ]
        for r in rows
    ]
    heads = ["config", "step ms", "warm", "cold", "block overhead % measured / warm / cold"]
    print(render_table(heads, table))
    print(
        f"median |step error|: warm {summary['median_abs_warm_step_error']:.1%}, "
        f"cold {summary['median_abs_cold_step_error']:.1%}; median |block overhead error|: "
        f"warm {100 * summary['median_abs_warm_overhead_error']:.1f} points, "
        f"cold {100 * summary['median_abs_cold_overhead_error']:.1f}"
    )
    record = {
        "benchmark": "cold_operands",
        "command": "python benchmarks/cold_operands.py --rounds " + str(args.rounds),
        "host": platform.node(),
        "torch": torch.__version__,
        "devices": {kind: d.to_dict() for kind, d in devices.items()},
        "summary": summary,
        "rows": rows,
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

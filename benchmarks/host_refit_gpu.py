"""Issue 14's H100 sweep re-priced with host dispatch (issue 25, item 4), on this machine, without a GPU.

benchmarks/results/time_model_gpu.json holds the measured step times of recompute's GPT-2 and a Llama on the H100
lent in issue 14 (eager PyTorch, bf16, every policy, paired rounds) and benchmarks/results/time_model_gpu_device.json
that device's calibration, made before host costs existed. This script traces each configuration's step again
(fake tensors, on this CPU), fits the host's costs on ONE configuration (``--fit``; default GPT-2 with SDPA at
s = 256, b = 8, the most host-bound: its device time is predicted at a third of its step): the plain step's
measured time over its kernels (per kernel and per optimizer kernel alike: the file has no split by phase), and
what ``block`` adds over the kernels it adds (per replayed kernel); then predicts every other configuration with
the phase rule (``recompute.core.timing``: max(host, device) per phase on a GPU), beside the bare launch under the
same rule and the predictions as published in issue 14 (a per-kernel max(kernel, launch)).

Not a calibration: ``recompute calibrate`` on the GPU measures the host on steps of its own models (item 6c of
issue 25 reruns the sweep with it when a GPU is lent). It shows what the rule does where the host bounds the
step, with one configuration's figures.

    python benchmarks/host_refit_gpu.py [--fit gpt2:flash:256:8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from time_model import models

from recompute import Workload
from recompute.core.policy import POLICIES
from recompute.core.table import render_table
from recompute.core.timing import Device, HostCost, StepWork, timing
from recompute.trace import cached_works

RESULTS = Path(__file__).parent / "results"
REPLAYING = [p for p in POLICIES if p != "none"]


def config_id(row: dict[str, Any]) -> str:
    return f"{row['model']}:{row['attention']}:{row['seq_len']}:{row['micro_batch']}"


def works_of(row: dict[str, Any]) -> dict[str, StepWork]:
    """Each policy's step work of a configuration of the sweep, traced on fake tensors (cached)."""
    spec = {"gpt2": models("cuda")["gpt"]}.get(row["model"], models("cuda")["llama"])
    wl = Workload(
        micro_batch=row["micro_batch"],
        seq_len=row["seq_len"],
        dtype="bf16",
        attention=row["attention"],
        device="cuda",
        keep_grads=False,
    )
    return cached_works(spec, wl, list(POLICIES))


def fit(row: dict[str, Any], works: dict[str, StepWork]) -> HostCost:
    """Host costs from one host-bound configuration: its measured steps over its traced kernels."""
    none, block = works["none"], works["block"]
    step = row["measured_step_s"]
    extra = step * row["policies"]["block"]["measured_overhead"]
    replayed = sum(block.replayed(none).values())
    per = step / none.kernels()
    source = (
        f"fitted on {config_id(row)} of benchmarks/results/time_model_gpu.json: {step * 1e3:.1f} ms for "
        f"{none.kernels()} kernels, block +{extra * 1e3:.1f} ms for {replayed} more"
    )
    return HostCost(per, extra / replayed, per, source=source)


def predict(row: dict[str, Any], works: dict[str, StepWork], device: Device) -> dict[str, Any]:
    times = {p: timing(works[p], works["none"], device) for p in POLICIES}
    return {
        "step_s": times["none"].step,
        "step_error": times["none"].step / row["measured_step_s"] - 1,
        "error_points": {p: 100 * (times[p].overhead - row["policies"][p]["measured_overhead"]) for p in REPLAYING},
    }


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {
        "median_abs_step_error": statistics.median(abs(r[key]["step_error"]) for r in rows),
        "median_abs_error_points": {
            p: statistics.median(abs(r[key]["error_points"][p]) for r in rows) for p in REPLAYING
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default="gpt2:flash:256:8", help="model:attention:s:b of the configuration to fit")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_refit_gpu.json")
    args = parser.parse_args()
    sweep = json.loads((RESULTS / "time_model_gpu.json").read_text())
    device = Device.load(RESULTS / "time_model_gpu_device.json")
    rows = {config_id(r): r for r in sweep["configs"]}
    if args.fit not in rows:
        sys.exit(f"--fit {args.fit!r} is not a configuration of the sweep; one of {', '.join(rows)}")
    works = {}
    for name, row in rows.items():
        print(f"tracing {name}", flush=True)
        works[name] = works_of(row)
    host = fit(rows[args.fit], works[args.fit])
    priced = dataclasses.replace(device, host=host)
    out = []
    for name, row in rows.items():
        if name == args.fit:
            continue
        out.append(
            {
                "config": name,
                "kernels": works[name]["none"].kernels(),
                "measured_step_s": row["measured_step_s"],
                "host": predict(row, works[name], priced),
                "bare": predict(row, works[name], device),
                "published": {
                    "step_error": row["step_error"],
                    "error_points": {p: v["error_points"] for p, v in row["policies"].items() if p != "none"},
                },
            }
        )
    result = {
        "benchmark": "host_refit_gpu",
        "command": "python " + " ".join(sys.argv),
        "device": device.label,
        "host": host.to_dict(),
        "summary": {key: summary(out, key) for key in ("host", "bare", "published")},
        "configs": out,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = [
        [
            r["config"],
            f"{r['measured_step_s'] * 1e3:.1f}",
            f"{r['host']['step_s'] * 1e3:.1f} ({r['host']['step_error']:+.0%})",
            f"{r['published']['step_error']:+.0%}",
            *(f"{r['host']['error_points'][p]:+.0f} / {r['published']['error_points'][p]:+.0f}" for p in REPLAYING),
        ]
        for r in out
    ]
    print(f"host costs: {host.kernel * 1e6:.1f} us per kernel, {host.replay * 1e6:.1f} us per replayed kernel")
    print(render_table(["config", "measured ms", "predicted", "published", *REPLAYING], table))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

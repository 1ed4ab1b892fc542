"""The planner's claim re-measured with time-based costs: plans made on predicted time against plans made on
FLOPs and against the best "policy on every k-th layer" setting that fits, at the same budgets, on this CPU.

The model is GPT-2-shaped with eager attention (its replay of the s^2 softmax is where FLOPs and time disagree
most). For budgets from 30 % to 90 % of the activations stored without recomputation it makes

  (a) the plan on predicted time: the step's kernels from the fake-tensor trace, priced on this CPU calibrated
      (``recompute calibrate``; ``--device-profile`` to reuse one),
  (b) the plan on recomputed FLOPs (the former default),
  (c) every-k candidates: for every policy and k, the settings whose estimate fits, the two fastest by
      predicted time and the one with the fewest FLOPs, of which the fastest measured counts,

then runs every distinct policy in rounds (one step each per round, built afresh; overhead = median over rounds of the
step time over the same round's ``none``, as in benchmarks/plan_vs_uniform.py, with the same allocator and
thread settings). Prints a table and writes benchmarks/results/plan_time_vs_flops.json.

    python benchmarks/plan_time_vs_flops.py [--rounds 10] [--seq-len 512] [--layers 8] [--hidden 384]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from plan_vs_uniform import paired_overhead, use_allocator

from recompute import ModelSpec, Policy, Workload, estimate
from recompute.bench import bench
from recompute.bench.calibrate import calibrate
from recompute.core.analytic.table import analytic_table
from recompute.core.errors import ConfigError
from recompute.core.plan import plan
from recompute.core.policy import POLICIES
from recompute.core.pricing import layer_costs
from recompute.core.table import render_table
from recompute.core.timing import Device, mixed_timing
from recompute.trace import cached_works

FRACTIONS = (0.3, 0.5, 0.7, 0.9)


def every_k_candidates(
    spec: ModelSpec, wl: Workload, budget: float, works: dict[str, Any], device: Device
) -> list[Policy]:
    """The every-k settings that fit ``budget``: the two fastest by predicted time and the fewest-FLOPs one."""
    fits = []
    for name in POLICIES:
        if name == "none":
            continue
        for every in range(1, spec.n_layers + 1):
            pol = Policy(name, every=every)
            est = estimate(spec, wl, pol)
            if est.peak <= budget:
                t = mixed_timing(works, pol.per_layer(spec.n_layers), device).step
                fits.append((t, est.recompute_flops, pol))
    if not fits:
        return []
    by_time = sorted(fits, key=lambda f: f[0])[:2]
    by_flops = min(fits, key=lambda f: f[1])
    return list({f[2].describe(): f[2] for f in [*by_time, by_flops]}.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--device-profile", type=Path, help="a `recompute calibrate -o` file of this CPU")
    args = parser.parse_args()
    use_allocator("reuse")
    torch.set_num_threads(1)
    spec = ModelSpec.from_name(
        "gpt2", n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, vocab=8192, dropout=0.0,
        max_positions=args.seq_len,
    )  # fmt: skip
    wl = Workload(
        seq_len=args.seq_len, micro_batch=1, dtype="fp32", device="cpu", precision="fp32", attention="eager",
        keep_grads=True,
    )  # fmt: skip
    device = Device.load(args.device_profile) if args.device_profile else calibrate("cpu", quick=True)
    works = cached_works(spec, wl, list(POLICIES))
    seconds, base = layer_costs(works, device, spec.n_layers)
    priced = analytic_table(
        spec, wl, seconds=seconds, model_seconds=base, cost_kind=f"predicted seconds on {device.label}"
    )
    none = estimate(spec, wl, "none")
    act = none.peak - none.states.total
    budgets = {f: none.states.total + f * act for f in FRACTIONS}
    made: dict[float, dict[str, Any]] = {}
    for f, b in budgets.items():
        try:
            by_time = plan(priced, b)
            by_flops = plan(analytic_table(spec, wl), b)
        except ConfigError as e:
            print(f"  {f:.0%} budget left out: {e}")
            continue
        made[f] = {"time": by_time, "flops": by_flops, "every_k": every_k_candidates(spec, wl, b, works, device)}
    policies = {"none": Policy("none")}
    for f, m in made.items():
        policies[f"time {f}"] = m["time"].policy
        policies[f"flops {f}"] = m["flops"].policy
        for pol in m["every_k"]:
            policies[pol.describe()] = pol
    distinct = list({p.describe(): p for p in policies.values()}.values())
    print(f"benching {len(distinct)} distinct policies, {args.rounds} rounds", flush=True)
    result = bench(spec, wl, distinct, steps=args.rounds, warmup=2, rounds=args.rounds)
    rows = {r.policy: r for r in result.rows}
    base = rows["none"].step_times

    def measured(pol: Policy) -> float:
        return paired_overhead(rows[pol.describe()].step_times, base)

    def predicted(pol: Policy) -> float:
        return mixed_timing(works, pol.per_layer(spec.n_layers), device).overhead

    table, records = [], []
    for f, m in made.items():
        every = sorted(m["every_k"], key=measured)
        best = every[0] if every else None
        rec = {
            "fraction": f,
            "budget": budgets[f],
            "time_plan": _point(m["time"].policy, rows, measured, predicted, budgets[f]),
            "flops_plan": _point(m["flops"].policy, rows, measured, predicted, budgets[f]),
            "every_k": [_point(p, rows, measured, predicted, budgets[f]) for p in every],
        }
        records.append(rec)
        table.append(
            [
                f"{f:.0%}",
                _counts(m["time"].policy, spec.n_layers),
                f"{100 * measured(m['time'].policy):+.1f}% ({100 * predicted(m['time'].policy):+.1f})",
                _counts(m["flops"].policy, spec.n_layers),
                f"{100 * measured(m['flops'].policy):+.1f}% ({100 * predicted(m['flops'].policy):+.1f})",
                best.describe() if best else "-",
                f"{100 * measured(best):+.1f}% ({100 * predicted(best):+.1f})" if best else "-",
            ]
        )
    print(
        render_table(
            [
                "budget",
                "(a) time plan",
                "overhead (pred.)",
                "(b) FLOPs plan",
                "overhead",
                "(c) best every-k",
                "overhead",
            ],
            table,
        )
    )
    out = Path(__file__).parent / "results" / "plan_time_vs_flops.json"
    out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1},
                "device": device.label,
                "device_source": device.source,
                "spec": spec.to_dict(),
                "workload": wl.to_dict(),
                "budgets": records,
                "bench": result.to_dict(),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


def _point(pol: Policy, rows: dict[str, Any], measured: Any, predicted: Any, budget: float) -> dict[str, Any]:
    row = rows[pol.describe()]
    return {
        "policy": pol.describe(),
        "layers": list(pol.layers) if pol.layers else None,
        "measured_overhead": measured(pol),
        "predicted_time_overhead": predicted(pol),
        "peak": row.peak,
        "fits": row.peak <= budget,
    }


def _counts(pol: Policy, n: int) -> str:
    layers = pol.per_layer(n)
    return ", ".join(f"{name} x{layers.count(name)}" for name in dict.fromkeys(layers))


if __name__ == "__main__":
    main()
